//! The vLLM paper's experiment on a real model: one pagedattn server per
//! memory policy (paging and the reservation baselines), same model, pool
//! and load, plus any outside server (llama.cpp's), offered Poisson load at
//! rising rates, interleaved rate by rate; for each, the highest rate whose
//! mean normalized latency meets the SLO.

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
    /// Requests per second, ascending.
    pub rates: Vec<f64>,
    /// The load (its arrivals are set per rate).
    pub load: LoadSpec,
    /// Stop raising a server's rate once it misses the SLO.
    pub stop_at_miss: bool,
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
    let mut missed = vec![false; servers.len()];
    for &rate in &cfg.rates {
        for (i, (name, target, _)) in servers.iter().enumerate() {
            if missed[i] && cfg.stop_at_miss {
                continue;
            }
            let spec = LoadSpec {
                arrivals: Arrivals::Poisson(rate),
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
            } else {
                missed[i] = true;
            }
            curves[i].points.push((rate, r));
            // Let the server settle between points.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
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
