//! The sampler against an f64 reference written here from the rules
//! alone: temperature, then top-k, then min-p (a token at least `min_p`
//! times as likely as the most likely), then top-p over what is left,
//! with logit bias and penalties applied to the logits first. Host only.

use pagedattn::rng::SplitMix64;
use pagedattn_model::defaults::{GenerationDefaults, GenerationOverrides};
use pagedattn_model::sample::{
    log_softmax, LogitBias, Penalties, Sampler, SamplingParams, Shaping, MAX_LOGIT_BIAS,
};

/// A fixed row of logits with ties, a long tail and negatives.
fn logits() -> Vec<f32> {
    let mut rng = SplitMix64::new(0x5eed);
    let mut l: Vec<f32> = (0..64)
        .map(|_| (rng.next_f64() * 8.0 - 4.0) as f32)
        .collect();
    l[3] = 5.0;
    l[17] = 5.0; // a tie with token 3
    l[40] = 4.5;
    l
}

/// The reference: the distribution the rules give, in f64, from the
/// logits (not from the sampler's log-probabilities).
fn reference(logits: &[f32], p: &SamplingParams) -> Vec<(u32, f64)> {
    let t = p.temperature as f64;
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Most likely first; ties by the lower id.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if p.top_k > 0 {
        order.truncate(p.top_k);
    }
    let zmax = logits[order[0]] as f64 / t;
    let prob: Vec<f64> = order
        .iter()
        .map(|&i| (logits[i] as f64 / t - zmax).exp())
        .collect();
    // min-p against the most likely, whose weight is 1.
    let keep = prob.iter().filter(|&&x| x >= p.min_p as f64).count();
    let (order, prob) = (&order[..keep], &prob[..keep]);
    let total: f64 = prob.iter().sum();
    let mut acc = 0.0;
    let mut kept = 0;
    for x in prob {
        acc += x / total;
        kept += 1;
        if p.top_p < 1.0 && acc >= p.top_p as f64 {
            break;
        }
    }
    let kept_total: f64 = prob[..kept].iter().sum();
    order[..kept]
        .iter()
        .zip(prob)
        .map(|(&i, &x)| (i as u32, x / kept_total))
        .collect()
}

fn params(temperature: f32, top_k: usize, top_p: f32, min_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        min_p,
        top_p,
        seed: 11,
    }
}

fn assert_same(got: &[(u32, f64)], want: &[(u32, f64)], what: &str) {
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        want.iter().map(|w| w.0).collect::<Vec<_>>(),
        "{what}: the tokens kept"
    );
    for (g, w) in got.iter().zip(want) {
        assert!(g.1.is_finite(), "{what}: token {} has {}", g.0, g.1);
        assert!(
            (g.1 - w.1).abs() <= 1e-9,
            "{what}: token {}: {} against {}",
            g.0,
            g.1,
            w.1
        );
    }
}

#[test]
fn the_distribution_matches_the_f64_reference() {
    let l = logits();
    let lp = log_softmax(&l);
    let mut cases = 0;
    for t in [0.3f32, 0.7, 1.0, 2.5] {
        for k in [0usize, 1, 5, 40] {
            for top_p in [1.0f32, 0.9, 0.5] {
                for min_p in [0.0f32, 0.05, 0.3, 1.0] {
                    let p = params(t, k, top_p, min_p);
                    let got = Sampler::new(p, 0).distribution(&lp);
                    assert_same(&got, &reference(&l, &p), &format!("{p:?}"));
                    let total: f64 = got.iter().map(|g| g.1).sum();
                    assert!((total - 1.0).abs() < 1e-12, "{p:?}: sums to {total}");
                    cases += 1;
                }
            }
        }
    }
    assert_eq!(cases, 192);
    // min_p 1 keeps only the most likely and its equals (the tie 3 / 17).
    let got = Sampler::new(params(1.0, 0, 1.0, 1.0), 0).distribution(&lp);
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![3, 17]);
}

#[test]
fn draws_follow_the_distribution_and_the_seed() {
    let l = logits();
    let lp = log_softmax(&l);
    let p = params(0.8, 0, 0.95, 0.05);
    let dist = Sampler::new(p, 0).distribution(&lp);
    assert!(dist.len() >= 4, "{dist:?}");
    let n = 40_000;
    let mut s = Sampler::new(p, 0);
    let mut count = vec![0usize; l.len()];
    for _ in 0..n {
        count[s.sample(&lp) as usize] += 1;
    }
    for &(t, q) in &dist {
        let f = count[t as usize] as f64 / n as f64;
        let sigma = (q * (1.0 - q) / n as f64).sqrt();
        assert!(
            (f - q).abs() <= 5.0 * sigma + 1e-4,
            "token {t}: drawn {f}, expected {q}"
        );
    }
    let outside: usize = (0..l.len() as u32)
        .filter(|t| !dist.iter().any(|d| d.0 == *t))
        .map(|t| count[t as usize])
        .sum();
    assert_eq!(outside, 0, "drawn outside what min_p and top_p keep");
    // Reproducible: a seed and a branch give one stream of draws; another
    // seed another.
    let draw = |seed: u64, branch: u64| -> Vec<u32> {
        let mut s = Sampler::new(SamplingParams { seed, ..p }, branch);
        (0..64).map(|_| s.sample(&lp)).collect()
    };
    assert_eq!(draw(7, 1), draw(7, 1));
    assert_ne!(draw(7, 1), draw(8, 1));
    assert_ne!(draw(7, 1), draw(7, 2));
}

#[test]
fn logit_bias_bans_forces_and_shifts() {
    let l = logits();
    let vocab = l.len();
    let none = Penalties::default();
    let hot = params(100.0, 0, 1.0, 0.0); // the flattest distribution there is
    let shaped = |entries: Vec<(u32, f32)>| -> Vec<f64> {
        let bias = LogitBias::new(entries, vocab).expect("a valid bias");
        Shaping {
            bias: &bias,
            penalties: none,
        }
        .apply(&l, &[], &[])
    };
    // -100 bans, even at temperature 100.
    let lp = shaped(vec![(3, -100.0), (17, -100.0)]);
    let d = Sampler::new(hot, 0).distribution(&lp);
    assert!(d.iter().all(|x| x.0 != 3 && x.0 != 17), "{d:?}");
    assert_eq!(d.len(), vocab - 2);
    let mut s = Sampler::new(hot, 0);
    assert!((0..5000).all(|_| {
        let t = s.sample(&lp);
        t != 3 && t != 17
    }));
    // Greedy takes the next best.
    let g = Sampler::new(params(0.0, 0, 1.0, 0.0), 0).sample(&lp);
    assert_eq!(g, 40);
    // +100 leaves only the tokens so biased, even at temperature 100, and
    // even for the least likely token.
    let worst = (0..vocab).min_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
    let lp = shaped(vec![(worst, 100.0)]);
    assert_eq!(Sampler::new(hot, 0).distribution(&lp), vec![(worst, 1.0)]);
    assert_eq!(Sampler::new(params(0.0, 0, 1.0, 0.0), 0).sample(&lp), worst);
    let lp = shaped(vec![(worst, 100.0), (5, 100.0), (9, 2.0)]);
    let d = Sampler::new(params(1.0, 0, 1.0, 0.0), 0).distribution(&lp);
    let mut kept: Vec<u32> = d.iter().map(|x| x.0).collect();
    kept.sort();
    let mut want = vec![worst, 5];
    want.sort();
    assert_eq!(kept, want);
    // Any other bias is added to the logit: the reference on shifted logits.
    let entries = vec![(40u32, 1.5f32), (3, -0.75), (60, 3.0)];
    let lp = shaped(entries.clone());
    let mut l2 = l.clone();
    for (t, b) in &entries {
        l2[*t as usize] += b;
    }
    let p = params(0.9, 10, 0.9, 0.02);
    assert_same(
        &Sampler::new(p, 0).distribution(&lp),
        &reference(&l2, &p),
        "an additive bias",
    );
    // The bias comes before the penalties (a banned token stays banned).
    let bias = LogitBias::new(vec![(3, -100.0)], vocab).unwrap();
    let lp = Shaping {
        bias: &bias,
        penalties: Penalties {
            repetition: 0.5,
            frequency: -2.0,
            ..none
        },
    }
    .apply(&l, &[3], &[3, 3]);
    assert_eq!(lp[3], f64::NEG_INFINITY);
    assert!(lp.iter().all(|x| !x.is_nan()));
}

#[test]
fn bad_logit_biases_are_refused_by_name() {
    let vocab = 1000;
    for (entries, want) in [
        (
            vec![(1000u32, 1.0f32)],
            "token 1000 outside the vocabulary of 1000",
        ),
        (vec![(5, 100.5)], "outside -100..=100"),
        (vec![(5, -101.0)], "outside -100..=100"),
        (vec![(5, f32::NAN)], "outside -100..=100"),
        (vec![(5, f32::INFINITY)], "outside -100..=100"),
        (vec![(5, 1.0), (5, 2.0)], "token 5 given twice"),
        (
            (0..=MAX_LOGIT_BIAS as u32).map(|t| (t, 1.0)).collect(),
            "at most 300",
        ),
    ] {
        let e = LogitBias::new(entries, vocab).unwrap_err().to_string();
        assert!(e.contains("logit_bias") && e.contains(want), "{e}");
    }
    assert_eq!(
        LogitBias::new(vec![(7, 1.0), (2, -3.0)], vocab)
            .unwrap()
            .entries(),
        &[(2, -3.0), (7, 1.0)]
    );
    let e = LogitBias::new((0..4).map(|t| (t, -100.0)).collect(), 4)
        .unwrap_err()
        .to_string();
    assert!(e.contains("bans every token"), "{e}");
    assert!(LogitBias::new((0..3).map(|t| (t, -100.0)).collect(), 4).is_ok());
    // min_p's range.
    for m in [-0.1f32, 1.5, f32::NAN] {
        let e = params(1.0, 0, 1.0, m).validate(10).unwrap_err().to_string();
        assert!(e.contains("min-p") && e.contains("0..=1"), "{e}");
    }
}

#[test]
fn defaults_fill_what_a_request_leaves_out() {
    use pagedattn_model::config::Arch;
    let d = GenerationDefaults::for_arch(Arch::Llama);
    // Given fields stay as given; the rest are the defaults.
    let p = d.params(Some(0.9), None, Some(3), None, 5);
    assert_eq!(
        (p.temperature, p.top_p, p.top_k, p.min_p, p.seed),
        (0.9, d.top_p, 3, d.min_p, 5)
    );
    // A greedy request gets no default penalty; a sampled one does; a
    // given one is kept.
    assert_eq!(d.repetition(None, Some(0.0)), 1.0);
    assert_eq!(d.repetition(None, None), d.repetition_penalty);
    assert_eq!(d.repetition(None, Some(0.8)), d.repetition_penalty);
    assert_eq!(d.repetition(Some(1.3), Some(0.0)), 1.3);
    assert!(
        d.max_tokens >= 16 && d.max_tokens <= 1024,
        "a bounded chat default"
    );
    assert_eq!(d.completion_tokens, 16);
    // Overrides replace, are checked, and set both routes' max_tokens.
    let o = GenerationOverrides {
        temperature: Some(0.0),
        max_tokens: Some(64),
        ..Default::default()
    };
    let r = GenerationDefaults::resolve(Arch::Gemma3, &o).unwrap();
    assert_eq!(
        (r.temperature, r.max_tokens, r.completion_tokens),
        (0.0, 64, 64)
    );
    assert_eq!(r.top_k, GenerationDefaults::for_arch(Arch::Gemma3).top_k);
    for (o, flag) in [
        (
            GenerationOverrides {
                top_p: Some(0.0),
                ..Default::default()
            },
            "--top-p",
        ),
        (
            GenerationOverrides {
                min_p: Some(2.0),
                ..Default::default()
            },
            "--min-p",
        ),
        (
            GenerationOverrides {
                repetition_penalty: Some(0.0),
                ..Default::default()
            },
            "--repetition-penalty",
        ),
        (
            GenerationOverrides {
                max_tokens: Some(0),
                ..Default::default()
            },
            "--max-tokens",
        ),
    ] {
        let e = GenerationDefaults::resolve(Arch::Llama, &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains(flag), "{e}");
    }
    // Every architecture's set is valid sampling.
    for arch in [Arch::Llama, Arch::Gemma3] {
        let d = GenerationDefaults::for_arch(arch);
        d.params(None, None, None, None, 0).validate(1000).unwrap();
        assert!(pagedattn_model::defaults::help().contains(&d.describe()));
    }
}
