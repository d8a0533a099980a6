//! `spex generate`: streams one policy's output as text, or every event as JSON lines;
//! `--record FILE` also writes the run as a trace.

use std::io::Write;

use super::{GenerateArgs, load_model};
use crate::engine::events::{DecodeEvent, FinishReason};
use crate::engine::{DecodeOptions, Decoder};
use crate::harness::race::{Lane, RaceEvent};
use crate::harness::trace::TraceWriter;

/// Runs `spex generate`: one-line errors for bad input; a failed write to stdout ends it.
pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let session = load_model(&args.model, args.policy.as_slice())?;
    let loaded = &session.loaded;
    let policy = args
        .policy
        .or(session.policy)
        .unwrap_or(crate::engine::PolicyKind::Speed);
    let options = (args.model).decode_options(args.max_tokens, args.sampling.resolve(&session)?);
    let mut decoder = Decoder::new(
        loaded,
        policy.build(),
        &session.prompt(&args.prompt)?,
        options,
    )?;
    let mut recorder = match &args.record {
        Some(path) => Some(recorder(path, &session, policy, &args.prompt, options)?),
        None => None,
    };
    let lane = trace_lane(policy);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if !args.json {
        write!(out, "{}", args.prompt)?;
    }
    let mut finished = None;
    while let Some(event) = decoder.next_event()? {
        if let DecodeEvent::Finished(f) = &event {
            finished = Some((f.reason, f.tokens.len()));
        }
        if let Some(r) = recorder.as_mut() {
            r.record(&RaceEvent::Decode {
                lane,
                event: event.clone(),
            })?;
        }
        write_event(&mut out, &event, args.json)?;
    }
    if !args.json {
        writeln!(out)?;
        // Fewer tokens than asked for, and stdout holds only the text: say why on stderr.
        if let Some((FinishReason::ContextFull, tokens)) = finished {
            let positions = loaded.model().config.positions;
            eprintln!(
                "spex: stopped after {tokens} of {} tokens: {}",
                args.max_tokens,
                context_full(options.context, positions)
            );
        }
    }
    if let Some(r) = recorder.as_mut() {
        r.record(&RaceEvent::Done)?;
    }
    Ok(())
}

/// A generate trace's one lane: the speculative one, or the baseline's.
fn trace_lane(policy: crate::engine::PolicyKind) -> Lane {
    match policy {
        crate::engine::PolicyKind::Baseline => Lane::Baseline,
        _ => Lane::Speculative,
    }
}

/// The trace `generate --record` writes: the session's header with this run's policy and
/// prompt.
fn recorder(
    path: &std::path::Path,
    session: &super::session::Session,
    policy: crate::engine::PolicyKind,
    prompt: &str,
    options: DecodeOptions,
) -> anyhow::Result<TraceWriter> {
    super::record::check_target(path, session)?;
    let mut header = super::record::header(session, options)?;
    (header.policy, header.prompt) = (policy, prompt.to_string());
    Ok(TraceWriter::create(path, &header)?)
}

/// Why a run stopped early with its context full: the cache holds `context.min(positions)`
/// (`engine::pipeline`), so whichever is smaller ran out.
fn context_full(context: usize, positions: usize) -> String {
    if context < positions {
        format!("the context of {context} positions is full (--context)")
    } else {
        format!("the model's {positions} positions are all used")
    }
}

/// One event on `out`: as a JSON line, or the text it commits.
fn write_event(out: &mut impl Write, event: &DecodeEvent, json: bool) -> anyhow::Result<()> {
    if json {
        serde_json::to_writer(&mut *out, event)?;
        writeln!(out)?;
        return Ok(());
    }
    match event {
        DecodeEvent::Prefill(p) => write!(out, "{}", p.first.text_delta)?,
        DecodeEvent::Step(s) => {
            for c in &s.committed {
                write!(out, "{}", c.text_delta)?;
            }
        }
        DecodeEvent::Finished(f) => write!(out, "{}", f.text_tail)?,
    }
    out.flush()?;
    Ok(())
}
