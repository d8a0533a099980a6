//! Lossy early exit (`policy::exit`): a fixed depth reads out the reference forward's pass N,
//! pass R is the baseline, the gate stops where the threshold rule does, the skipped passes
//! hold copies of the exit pass's KV entries, and the lossless lanes are untouched.
#![allow(clippy::unwrap_used, reason = "a test's unwrap is its assertion")]

mod common;

use common::{OPTIONS, PROMPTS, Variant, assert_clean_error, random_model, reference_logits, spec};
use spex::engine::events::RowEvent;
use spex::engine::exit_gate::exits_at;
use spex::engine::exit_gate::{self, ExitThreshold};
use spex::engine::pass::Pass;
use spex::engine::policy::PolicyKind;
use spex::engine::{DecodeEvent, DecodeOptions, Decoder, LoadedModel};

fn exit(rule: &str) -> PolicyKind {
    format!("exit:{rule}").parse().unwrap()
}

/// The argmax of `logits`, or `None` where the top two are within `1e-3` (a near-tie the
/// step's rounding may resolve either way).
fn clear_argmax(logits: &[f32]) -> Option<u32> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    (logits[order[0]] - logits[order[1]] > 1e-3).then_some(order[0] as u32)
}

/// Each decoded position's rows, by position, in pass order.
fn rows_by_position(rows: &[RowEvent]) -> std::collections::BTreeMap<usize, Vec<&RowEvent>> {
    let mut by_pos: std::collections::BTreeMap<usize, Vec<&RowEvent>> = Default::default();
    for row in rows {
        by_pos.entry(row.pos).or_default().push(row);
    }
    by_pos
}

/// `exit:pass=N` commits the argmax of pass N's readout over its own text, which is the
/// reference forward's pass-N readout: a token's passes 1..N read only passes 1..N of the
/// positions before it, so the copies in the deeper passes are never read. Every decoded
/// position runs exactly N rows, and `exit:pass=R` is the baseline token for token.
#[test]
fn a_fixed_depth_reads_out_the_reference_forward_at_that_pass() {
    let shapes = [
        spec(2, 4, Variant::Untied, 3),
        spec(1, 3, Variant::Gqa, 5),
        spec(2, 2, Variant::Tied, 7),
    ];
    let mut checked = 0;
    for shape in &shapes {
        let (_dir, loaded) = random_model(shape);
        let passes = loaded.model().passes();
        for prompt in &PROMPTS[..4] {
            let plen = loaded.tokenizer.encode(prompt).unwrap().len();
            for n in 1..=passes {
                let (rows, tokens) =
                    common::decoded_rows(&loaded, exit(&format!("pass={n}")), prompt, OPTIONS);
                let mut ids = loaded.tokenizer.encode(prompt).unwrap();
                ids.extend(&tokens);
                let reference = reference_logits(&loaded, &ids);
                for (k, &token) in tokens.iter().enumerate() {
                    // The first token comes from the prefill's pass R.
                    let pass = if k == 0 { passes } else { n };
                    if let Some(want) = clear_argmax(&reference[pass - 1][plen + k - 1]) {
                        assert_eq!(token, want, "{prompt:?} exit:pass={n}, token {k}");
                        checked += 1;
                    }
                }
                for (pos, rows) in rows_by_position(&rows) {
                    let passes_run: Vec<usize> = rows.iter().map(|r| r.pass.number()).collect();
                    assert_eq!(passes_run, (1..=n).collect::<Vec<_>>(), "position {pos}");
                }
                if n == passes {
                    let (_, baseline) =
                        common::decoded_rows(&loaded, PolicyKind::Baseline, prompt, OPTIONS);
                    assert_eq!(tokens, baseline, "{prompt:?}: exit:pass=R is the baseline");
                }
            }
        }
    }
    assert!(checked > 500, "{checked} tokens checked");
}

/// `exit:gate=T` stops every token at the first pass whose cumulative exit probability, from
/// the λ its rows report, reaches T: mlx-lm's threshold rule (`exit_gate::threshold_exit`).
#[test]
fn the_gate_stops_each_token_where_the_threshold_rule_does() {
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Untied, 11));
    let passes = loaded.model().passes();
    let (mut early, mut full) = (0, 0);
    for threshold in [0.3f32, 0.5, 0.8] {
        for prompt in &PROMPTS[..3] {
            let policy = exit(&format!("gate={threshold}"));
            let (rows, _) = common::decoded_rows(&loaded, policy, prompt, OPTIONS);
            let by_pos = rows_by_position(&rows);
            let last = by_pos.keys().max().copied();
            for (pos, rows) in by_pos.into_iter().filter(|(pos, _)| Some(*pos) != last) {
                let lambdas: Vec<f32> = rows.iter().map(|r| r.exit_probability.unwrap()).collect();
                let cumulative = |r: usize| exits_at(&lambdas[..r]).iter().sum::<f32>();
                let stop = (1..passes)
                    .find(|&r| r <= lambdas.len() && cumulative(r) >= threshold)
                    .unwrap_or(passes);
                assert_eq!(
                    rows.len(),
                    stop,
                    "position {pos} at {threshold}: λ {lambdas:?}"
                );
                if stop < passes {
                    early += 1;
                } else {
                    full += 1;
                }
            }
        }
    }
    assert!(
        early > 20 && full > 20,
        "{early} early exits, {full} full depth"
    );
}

/// Bare `exit:gate` stops at the run's threshold: `--exit-threshold` (`DecodeOptions`) where
/// given, else the checkpoint's `early_exit_threshold`. The random checkpoint's config holds
/// Ouro's 1.0, at which no token stops early and the lane's text is the baseline's; the prefill
/// event reports the threshold the run used.
#[test]
fn bare_gate_exits_at_the_runs_threshold() {
    let (dir, loaded) = random_model(&spec(2, 4, Variant::Untied, 11));
    for prompt in &PROMPTS[..3] {
        let half = DecodeOptions {
            exit_threshold: ExitThreshold::new(0.5),
            ..OPTIONS
        };
        let (_, bare) = common::decoded_rows(&loaded, exit("gate"), prompt, half);
        let (_, explicit) = common::decoded_rows(&loaded, exit("gate=0.5"), prompt, OPTIONS);
        assert_eq!(bare, explicit, "{prompt:?}");
        let (rows, every) = common::decoded_rows(&loaded, exit("gate"), prompt, OPTIONS);
        let (_, baseline) = common::decoded_rows(&loaded, PolicyKind::Baseline, prompt, OPTIONS);
        assert_eq!(every, baseline, "{prompt:?}: threshold 1 runs every pass");
        assert!(rows_by_position(&rows).values().all(|r| r.len() == 4));
    }
    let d = dir.path().display().to_string();
    let json = common::spex_ok(
        &[
            "generate",
            "--model",
            &d,
            "--prompt",
            "To be",
            "--max-tokens",
            "2",
            "--json",
            "--exit-threshold",
            "0.7",
        ],
        &[],
        dir.path(),
    );
    let prefill = String::from_utf8(json).unwrap();
    let prefill = prefill.lines().find(|l| l.contains("\"prefill\"")).unwrap();
    assert!(prefill.contains("\"exit_threshold\":0.7"), "{prefill}");
}

/// Every committed token reports where the gate stops its predicting token
/// (`Committed::gate_exit`): under the baseline, the threshold rule over the λ of all R of
/// that token's rows; under `exit:gate`, the pass the lane stopped it at.
#[test]
fn each_commit_reports_the_gates_exit_pass() {
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Untied, 11));
    let half = DecodeOptions {
        exit_threshold: ExitThreshold::new(0.5),
        ..OPTIONS
    };
    let (mut early, mut checked) = (0, 0);
    for (policy, prompt) in [("baseline", PROMPTS[0]), ("exit:gate", PROMPTS[1])] {
        let mut decoder = Decoder::new(
            &loaded,
            policy.parse::<PolicyKind>().unwrap().build(),
            prompt,
            half,
        )
        .unwrap();
        let mut rows: Vec<RowEvent> = Vec::new();
        while let Some(event) = decoder.next_event().unwrap() {
            let DecodeEvent::Step(step) = event else {
                continue;
            };
            rows.extend(step.rows);
            for c in &step.committed {
                let mine: Vec<&RowEvent> = rows.iter().filter(|r| r.pos + 1 == c.pos).collect();
                let lambdas: Vec<f32> = mine.iter().map(|r| r.exit_probability.unwrap()).collect();
                let t = ExitThreshold::new(0.5).unwrap();
                let want = exit_gate::known_exit(&lambdas, 4, t);
                assert_eq!(c.gate_exit, want, "{policy} position {}", c.pos);
                if policy == "exit:gate" {
                    assert_eq!(c.gate_exit.map(|p| p.number()), Some(mine.len()));
                }
                early += usize::from(c.gate_exit.is_some_and(|p| p.number() < 4));
                checked += 1;
            }
        }
    }
    assert!(checked > 20 && early > 5, "{early} of {checked} stop early");
}

/// The held-out cross-entropy of a fixed depth is the mean −log softmax of the reference
/// forward's pass-N readout at each next token; at pass R it is the baseline's. The gate's
/// rule lies between its shallowest and deepest choices, and `spex bench --held-out` reports it
/// for the lossy lanes only (one line where none is raced).
#[test]
fn held_out_loss_reads_out_each_position_where_its_rule_stops() {
    use spex::harness::exit_loss::held_out_loss;
    let (dir, loaded) = random_model(&spec(2, 4, Variant::Untied, 11));
    let windows: Vec<Vec<u32>> = (PROMPTS[..3].iter())
        .map(|p| loaded.tokenizer.encode(p).unwrap())
        .collect();
    let threshold = ExitThreshold::new(0.5).unwrap();
    let mut by_pass = Vec::new();
    for n in 1..=4 {
        let rule = spex::engine::policy::ExitRule::Pass(Pass::new(n).unwrap());
        let loss = held_out_loss(loaded.model(), rule, threshold, &windows).unwrap();
        let (mut nats, mut tokens) = (0.0f64, 0usize);
        for w in &windows {
            let reference = reference_logits(&loaded, w);
            for t in 0..w.len() - 1 {
                let l = &reference[n - 1][t];
                let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let sum: f64 = l.iter().map(|&x| f64::from(x - max).exp()).sum();
                nats += sum.ln() - f64::from(l[w[t + 1] as usize] - max);
                tokens += 1;
            }
        }
        assert_eq!(loss.tokens, tokens);
        assert!(
            (loss.nats - nats / tokens as f64).abs() < 1e-4,
            "pass {n}: {loss:?}"
        );
        assert!((loss.passes_per_token - n as f64).abs() < 1e-12);
        if n == 4 {
            assert_eq!(loss.nats, loss.baseline_nats);
        }
        by_pass.push(loss.nats);
    }
    let gate = exit("gate=0.5");
    let spex::engine::policy::PolicyKind::Exit { rule, .. } = gate else {
        unreachable!()
    };
    let loss = held_out_loss(loaded.model(), rule, threshold, &windows).unwrap();
    assert!((1.0..=4.0).contains(&loss.passes_per_token), "{loss:?}");
    let lo = by_pass.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = by_pass.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    assert!(
        loss.nats >= lo - 0.5 && loss.nats <= hi + 0.5,
        "{loss:?} against {by_pass:?}"
    );
    let d = dir.path().display().to_string();
    let t = held_out_text(dir.path());
    let bench = |policy: &str| {
        [
            "bench",
            "--model",
            &d,
            "--max-tokens",
            "4",
            "--runs",
            "1",
            "--json",
            "--policy",
            policy,
            "--held-out",
            &t,
        ]
        .map(String::from)
        .to_vec()
    };
    let args = bench("exit:pass=2,speed");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let json: serde_json::Value =
        serde_json::from_slice(&common::spex_ok(&args, &[], dir.path())).unwrap();
    let policies = json["overall"]["policies"].as_array().unwrap();
    let held_out = &policies[0]["lossy"]["held_out"];
    assert!(held_out["nats"].as_f64().unwrap() > 0.0, "{held_out}");
    assert!(policies[1]["lossy"].is_null());
    let args = bench("speed");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(
        &args,
        "--held-out scores the lossy lanes' exit rules, and none is raced",
    );
}

/// After a token exits at pass p, every deeper pass holds a copy of its pass-p K/V entry, in
/// every layer: later tokens attend to it at every pass.
#[test]
fn skipped_passes_hold_copies_of_the_exit_pass_entries() {
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Gqa, 13));
    let plen = loaded.tokenizer.encode(PROMPTS[0]).unwrap().len();
    for n in 1..4 {
        let mut decoder = run_to_end(&loaded, exit(&format!("pass={n}")), PROMPTS[0]);
        // The last committed token never ran: positions up to the one before it exited.
        let len = plen + decoder.output().len() - 1;
        for layer in 0..2 {
            let at = |pass: usize| {
                decoder
                    .kv_entries(layer, Pass::new(pass).unwrap(), len)
                    .unwrap()
            };
            let (k_exit, v_exit) = at(n);
            let width = k_exit.len() / len;
            for deeper in n + 1..=4 {
                let (k, v) = at(deeper);
                let decoded = plen * width..len * width;
                assert_eq!(
                    k[decoded.clone()],
                    k_exit[decoded.clone()],
                    "layer {layer} pass {deeper} keys"
                );
                assert_eq!(
                    v[decoded.clone()],
                    v_exit[decoded],
                    "layer {layer} pass {deeper} values"
                );
                // The prompt's own deeper entries are its own, not copies.
                assert_ne!(k[..plen * width], k_exit[..plen * width]);
            }
        }
        decoder.cancel();
    }
}

/// `fill=project` writes a stopped token's exit state, projected through each layer's own K/V
/// weights, at the next pass and copies it deeper. The next pass's first layer takes exactly
/// that state as its input, so there the entry is the baseline's own (for the first decoded
/// token, whose history both runs share); deeper layers' entries are approximations, unlike
/// the copy's.
#[test]
fn a_projected_fill_is_the_next_pass_first_layer_entry() {
    let (_dir, loaded) = random_model(&spec(2, 4, Variant::Gqa, 13));
    let plen = loaded.tokenizer.encode(PROMPTS[0]).unwrap().len();
    let mut projected = run_to_end(&loaded, exit("pass=1:fill=project"), PROMPTS[0]);
    let mut baseline = run_to_end(&loaded, PolicyKind::Baseline, PROMPTS[0]);
    let mut copied = run_to_end(&loaded, exit("pass=1"), PROMPTS[0]);
    let len = plen + projected.output().len() - 1;
    let entry = |d: &Decoder, layer: usize, pass: usize| {
        let (k, v) = d.kv_entries(layer, Pass::new(pass).unwrap(), len).unwrap();
        let width = k.len() / len;
        let at = |x: &[f32]| x[plen * width..(plen + 1) * width].to_vec();
        (at(&k), at(&v))
    };
    assert_eq!(
        entry(&projected, 0, 2),
        entry(&baseline, 0, 2),
        "layer 1 is exact"
    );
    assert_ne!(entry(&projected, 1, 2), entry(&baseline, 1, 2));
    assert_ne!(entry(&projected, 0, 2), entry(&copied, 0, 2));
    for layer in 0..2 {
        for deeper in 3..=4 {
            assert_eq!(
                entry(&projected, layer, deeper),
                entry(&projected, layer, 2)
            );
        }
    }
    assert_eq!(
        "exit:pass=1:fill=project",
        exit("pass=1:fill=project").to_string()
    );
    for d in [&mut projected, &mut baseline, &mut copied] {
        d.cancel();
    }
}

/// The prompts as a held-out text file in `dir`; its path.
fn held_out_text(dir: &std::path::Path) -> String {
    let text = dir.join("held_out.txt");
    std::fs::write(&text, PROMPTS.join("\n")).unwrap();
    text.display().to_string()
}

fn run_to_end(loaded: &LoadedModel, policy: PolicyKind, prompt: &str) -> Decoder {
    let mut decoder = Decoder::new(loaded, policy.build(), prompt, OPTIONS).unwrap();
    while let Some(event) = decoder.next_event().unwrap() {
        if matches!(event, DecodeEvent::Finished(_)) {
            break;
        }
    }
    decoder
}

/// A threshold outside (0, 1], a depth outside 1..R, the gate on a checkpoint without one, and
/// a lossy lane in a what-if replay: one line each.
#[test]
fn bad_exit_rules_get_one_line() {
    for bad in [
        "exit:gate=0",
        "exit:gate=1.5",
        "exit:confidence=-0.1",
        "exit:confidence=x",
    ] {
        assert_clean_error(
            &["bench", "--policy", bad],
            "must be a probability in (0, 1]",
        );
    }
    assert_clean_error(&["bench", "--policy", "exit:confidence"], "needs a value");
    assert_clean_error(
        &["bench", "--policy", "exit:pass=1:fill=mean"],
        "fill=`mean`: expected fill=copy or fill=project",
    );
    for bad in ["0", "1.5", "half"] {
        assert_clean_error(
            &["bench", "--exit-threshold", bad],
            "must be a probability in (0, 1]",
        );
    }
    assert_clean_error(
        &["bench", "--policy", "exit:pass=0"],
        "pass=N: N is the pass",
    );
    assert_clean_error(
        &["bench", "--policy", "exit:depth=2"],
        "expected gate[=T], confidence=P or pass=N",
    );
    let (dir, _) = random_model(&spec(1, 3, Variant::Tied, 1));
    let d = dir.path().display().to_string();
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    let bad = text.replace(
        "\"early_exit_threshold\": 1.0",
        "\"early_exit_threshold\": 2.0",
    );
    assert_ne!(bad, text);
    std::fs::write(&config, bad).unwrap();
    assert_clean_error(
        &["generate", "--model", &d, "--prompt", "To be"],
        "field `early_exit_threshold`: 2.0 must be a probability in (0, 1]",
    );
    std::fs::write(&config, text).unwrap();
    let generate = |policy: &str| {
        [
            "generate", "--model", &d, "--prompt", "To be", "--policy", policy,
        ]
        .map(String::from)
    };
    let args = generate("exit:pass=4");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    assert_clean_error(
        &args,
        "exit:pass=4: the model has 3 passes (N must be 1 to 3)",
    );
    // A GGUF holds no exit gate.
    let q8 = spex::engine::gguf::write::FileType::Q8_0;
    let (_dir, _out, gguf) = common::quantized_pair(Variant::Tied, 1, 3, 1, q8);
    let g = gguf.display().to_string();
    let args = [
        "generate",
        "--model",
        &g,
        "--prompt",
        "To be",
        "--policy",
        "exit:gate",
    ];
    assert_clean_error(&args, "exit:gate reads the checkpoint's exit gate");
    // The held-out score runs the reference forward, which reads float weights.
    let t = held_out_text(dir.path());
    let args = [
        "bench",
        "--model",
        &g,
        "--policy",
        "exit:pass=1",
        "--held-out",
        &t,
    ];
    assert_clean_error(&args, "which reads float weights; this model's are Q8_0");
    let err = spex::harness::what_if::WhatIf::of(Vec::new(), &[exit("pass=1")]).unwrap_err();
    assert!(err.to_string().contains("a lossy early exit"), "{err}");
    // A trace of a lossy lane cannot be replayed under other policies.
    let trace = dir.path().join("exit.jsonl");
    let t = trace.display().to_string();
    let record = [
        "generate",
        "--model",
        &d,
        "--prompt",
        "To be",
        "--policy",
        "exit:pass=1",
    ];
    common::spex_ok(
        &[&record[..], &["--max-tokens", "6", "--record", &t]].concat(),
        &[],
        dir.path(),
    );
    assert_clean_error(
        &["explain", &t, "--what-if", "speed"],
        "what-if re-simulates lossless runs only (this run is exit:pass=1",
    );
}

/// `spex train-gate` fits the gate alone: the copy it writes differs from the checkpoint in the
/// gate's bytes only, its held-out cross-entropy is below the untrained gate's, and the copy
/// decodes the same text as the original. An existing `--out` is one line.
#[test]
fn train_gate_changes_the_gate_bytes_only() {
    let (dir, _) = random_model(&spec(1, 3, Variant::Untied, 21));
    let corpus = dir.path().join("corpus");
    std::fs::create_dir(&corpus).unwrap();
    for (name, text) in [
        ("a.txt", PROMPTS[..10].join("\n")),
        ("held.txt", PROMPTS[10..].join("\n")),
    ] {
        std::fs::write(corpus.join(name), text.repeat(8)).unwrap();
    }
    let (d, out) = (dir.path().display().to_string(), dir.path().join("gated"));
    let (a, h, o) = (
        corpus.join("a.txt").display().to_string(),
        corpus.join("held.txt").display().to_string(),
        out.display().to_string(),
    );
    let args = [
        "train-gate",
        "--model",
        &d,
        "--corpus",
        &a,
        &h,
        "--held-out",
        "held.txt",
        "--windows",
        "4",
        "--seq-len",
        "32",
        "--steps",
        "100",
        "--out",
        &o,
        "--json",
    ];
    let report: serde_json::Value =
        serde_json::from_slice(&common::spex_ok(&args, &[], dir.path())).unwrap();
    let before = report["before"]["cross_entropy"].as_f64().unwrap();
    let after = report["held_out"]["cross_entropy"].as_f64().unwrap();
    assert!(after < before, "{report}");
    let (old, new) = (
        std::fs::read(dir.path().join("model.safetensors")).unwrap(),
        std::fs::read(out.join("model.safetensors")).unwrap(),
    );
    assert_eq!(old.len(), new.len());
    let header = 8 + u64::from_le_bytes(old[..8].try_into().unwrap()) as usize;
    let (_, names) = safetensors::SafeTensors::read_metadata(&old).unwrap();
    let gate_bytes: Vec<(usize, usize)> = [
        spex::engine::format::EXIT_GATE_WEIGHT,
        spex::engine::format::EXIT_GATE_BIAS,
    ]
    .map(|n| names.info(n).unwrap().data_offsets)
    .map(|(b, e)| (header + b, header + e))
    .to_vec();
    let differing: Vec<usize> = (0..old.len()).filter(|&i| old[i] != new[i]).collect();
    assert!(!differing.is_empty());
    assert!(
        differing
            .iter()
            .all(|&i| gate_bytes.iter().any(|&(b, e)| (b..e).contains(&i))),
        "bytes outside the gate changed"
    );
    let generate = |m: &str| {
        common::spex_ok(
            &[
                "generate",
                "--model",
                m,
                "--prompt",
                "To be",
                "--max-tokens",
                "8",
            ],
            &[],
            dir.path(),
        )
    };
    assert_eq!(generate(&d), generate(&o));
    assert_clean_error(
        &args
            .map(String::from)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
        "already exists",
    );
}
