//! Runs `examples/engine.rs` (a toy decoder served through the plan/run
//! API on the engine's own device) and checks what it reports: every step's
//! logits match the f64 model, parallel samples copied on write, request B
//! hit the prefix cache. Skips without an adapter unless
//! `PAGEDATTN_REQUIRE_GPU=1`.

use crate::engine;

#[test]
fn engine_example_serves_and_matches_the_f64_model() {
    let (device, queue) = match engine::engine_device() {
        Ok(d) => d,
        Err(e) => {
            if std::env::var("PAGEDATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("PAGEDATTN_REQUIRE_GPU=1 but no adapter: {e}");
            }
            eprintln!("skipped: {e}");
            return;
        }
    };
    let s = engine::run_on(&device, &queue, true).expect("the engine example runs");
    eprintln!("{s:?}");
    // A's prefill, the mixed step (B's prompt with A's samples), then decodes
    // until B's 8th token: 9 steps.
    assert_eq!(s.steps, 9, "{s:?}");
    assert_eq!(s.generated.len(), 5, "A's 4 samples and B");
    assert!(s.generated.iter().all(|(_, t)| t.len() == 8));
    // Sample k takes the k-th best token: A's samples all differ at once.
    let firsts: std::collections::HashSet<u32> = s
        .generated
        .iter()
        .filter(|(n, _)| n.starts_with('A'))
        .map(|(_, t)| t[0])
        .collect();
    assert_eq!(firsts.len(), 4, "{s:?}");
    assert!(
        s.copies >= 3,
        "diverging samples copy their shared block: {s:?}"
    );
    assert_eq!(s.prefix_hit_tokens, 32, "B reuses A's two full blocks");
    assert!(s.peak_blocks_shared >= 2, "{s:?}");
    assert!(s.max_err < s.tol && s.tol <= 1e-4, "{s:?}");
    assert_eq!(
        s.objects_after_warmup, 0,
        "steady steps create nothing: {s:?}"
    );
}
