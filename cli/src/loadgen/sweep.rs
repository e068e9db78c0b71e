//! The vLLM paper's experiment on a real model: one pagedattn server per
//! memory policy (paging and the reservation baselines), same model, pool
//! and load, plus any outside server (llama.cpp's), offered Poisson load;
//! each server searches a list of rates (up while it meets the SLO, down
//! while it misses), the servers taking turns point by point, to pin the
//! highest rate whose mean normalized latency meets the SLO.

use std::time::Duration;

use pagedattn::blocks::Reservation;
use pagedattn_server::{Handle, ServeConfig};
use serde::Serialize;

use super::{run, Arrivals, LoadSpec, RunReport, Target};

/// What to sweep.
#[derive(Clone, Debug)]
pub struct SweepConfig {
    /// The servers' configuration (its reservation is set per policy).
    pub server: ServeConfig,
    pub policies: Vec<Reservation>,
    /// Outside servers, by name (`llama.cpp` at `http://...`).
    pub external: Vec<(String, Target)>,
    /// Request rates, requests per second, rising.
    pub rates: Vec<f64>,
    /// Where each server's search starts in `rates`.
    pub start: usize,
    /// The load (its arrivals and request count are set per point).
    pub load: LoadSpec,
    /// Seconds of arrivals a point offers (its requests: the rate times
    /// this, at least `min_requests`).
    pub point_seconds: f64,
    pub min_requests: usize,
    /// Every rate for every server, instead of searching.
    pub full: bool,
}

/// One server's rate points.
#[derive(Clone, Debug, Serialize)]
pub struct Curve {
    pub server: String,
    pub points: Vec<(f64, RunReport)>,
    /// The highest rate that met the SLO (every request completed and the
    /// mean normalized latency under it); 0 if none did.
    pub sustained: f64,
}

/// The sweep's result.
#[derive(Clone, Debug, Serialize)]
pub struct SweepReport {
    pub curves: Vec<Curve>,
    pub slo: f64,
}

fn meets(r: &RunReport, slo: f64) -> bool {
    r.failed == 0 && r.completed > 0 && r.normalized_latency.mean <= slo
}

/// Runs the sweep; `progress` hears a line per point.
pub async fn sweep(
    cfg: &SweepConfig,
    progress: &mut dyn FnMut(&str),
) -> Result<SweepReport, String> {
    let mut servers: Vec<(String, Target, Option<Handle>)> = Vec::new();
    for &policy in &cfg.policies {
        let sc = ServeConfig {
            reservation: policy,
            port: 0,
            ..cfg.server.clone()
        };
        let name = sc.model_name();
        let h = tokio::task::spawn_blocking(move || Handle::start(sc))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("the {} server: {e}", policy.name()))?;
        let target = Target {
            base: format!("http://{}", h.addr),
            model: name,
            api_key: None,
            scrape: true,
        };
        progress(&format!(
            "started the {} server on {}",
            policy.name(),
            target.base
        ));
        servers.push((policy.name().to_string(), target, Some(h)));
    }
    for (name, t) in &cfg.external {
        servers.push((name.clone(), t.clone(), None));
    }
    let mut curves: Vec<Curve> = servers
        .iter()
        .map(|(n, _, _)| Curve {
            server: n.clone(),
            points: Vec::new(),
            sustained: 0.0,
        })
        .collect();
    // Each server searches from `start`: up while it meets the SLO, down
    // while it misses, until the highest rate it meets is pinned (or
    // every rate, with `full`). Rounds interleave the servers.
    #[derive(Clone, Copy, PartialEq)]
    enum Dir {
        Start,
        Up,
        Down,
        Done,
    }
    let start = cfg.start.min(cfg.rates.len().saturating_sub(1));
    let mut at: Vec<(usize, Dir)> =
        vec![(if cfg.full { 0 } else { start }, Dir::Start); servers.len()];
    while at.iter().any(|&(_, d)| d != Dir::Done) {
        for (i, (name, target, _)) in servers.iter().enumerate() {
            let (idx, dir) = at[i];
            if dir == Dir::Done {
                continue;
            }
            let rate = cfg.rates[idx];
            let requests = ((rate * cfg.point_seconds).ceil() as usize).max(cfg.min_requests);
            let spec = LoadSpec {
                arrivals: Arrivals::Poisson(rate),
                requests,
                ..cfg.load.clone()
            };
            let r = run(target, &spec).await;
            let ok = meets(&r, cfg.load.slo);
            progress(&format!(
                "{name:>9} at {rate:.2} req/s: {}/{} done, normalized latency {:.0} ms/token (p99 {:.0}), peak batch {}{}",
                r.completed,
                r.requests,
                r.normalized_latency.mean * 1e3,
                r.normalized_latency.p99 * 1e3,
                r.peaks.map_or("-".to_string(), |p| format!("{:.0}", p.running)),
                if ok { "" } else { "  (misses the SLO)" }
            ));
            if ok {
                curves[i].sustained = curves[i].sustained.max(rate);
            }
            curves[i].points.push((rate, r));
            let last = cfg.rates.len() - 1;
            at[i] = if cfg.full {
                if idx == last {
                    (idx, Dir::Done)
                } else {
                    (idx + 1, Dir::Up)
                }
            } else {
                match (ok, dir) {
                    (true, Dir::Down) => (idx, Dir::Done),
                    (true, _) if idx == last => (idx, Dir::Done),
                    (true, _) => (idx + 1, Dir::Up),
                    (false, Dir::Up) => (idx, Dir::Done),
                    (false, _) if idx == 0 => (idx, Dir::Done),
                    (false, _) => (idx - 1, Dir::Down),
                }
            };
            // Let the server settle between points.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    for c in &mut curves {
        c.points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    for (_, _, h) in servers {
        if let Some(h) = h {
            let _ = tokio::task::spawn_blocking(move || h.stop()).await;
        }
    }
    Ok(SweepReport {
        curves,
        slo: cfg.load.slo,
    })
}

/// The sweep as a table: each server's sustained rate and its ratio to
/// the `max` reservation's.
pub fn render_sweep(r: &SweepReport) -> String {
    let base = r
        .curves
        .iter()
        .find(|c| c.server == "max")
        .map_or(0.0, |c| c.sustained);
    let mut s = format!(
        "sustained request rate (mean normalized latency <= {:.0} ms/token, every request completed)\n server      req/s   vs max  points (rate: normalized latency ms/token, peak batch)\n",
        r.slo * 1e3
    );
    for c in &r.curves {
        let ratio = if base > 0.0 {
            format!("{:>6.2}x", c.sustained / base)
        } else {
            format!("{:>7}", "-")
        };
        let pts: Vec<String> = c
            .points
            .iter()
            .map(|(rate, p)| {
                let b = p.peaks.map_or("-".into(), |x| format!("{:.0}", x.running));
                format!("{rate:.2}: {:.0}, {b}", p.normalized_latency.mean * 1e3)
            })
            .collect();
        s += &format!(
            " {:<10} {:>6.2}  {ratio}  {}\n",
            c.server,
            c.sustained,
            pts.join(" | ")
        );
    }
    s
}
