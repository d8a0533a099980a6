//! `spex generate`: streams one policy's output as text, or every event as JSON lines.

use std::io::Write;

use super::{GenerateArgs, load_model};
use crate::engine::events::DecodeEvent;
use crate::engine::tokenizer::Detokenizer;
use crate::engine::{DecodeOptions, Decoder};

pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let loaded = load_model(&args.model)?;
    let options = DecodeOptions {
        max_tokens: args.max_tokens,
        context: args.model.context,
    };
    let mut decoder = Decoder::new(&loaded, args.policy.build(), &args.prompt, options)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut detok = Detokenizer::default();
    if !args.json {
        write!(out, "{}", args.prompt)?;
    }
    while let Some(event) = decoder.next_event()? {
        if args.json {
            serde_json::to_writer(&mut out, &event)?;
            writeln!(out)?;
            continue;
        }
        let committed = match &event {
            DecodeEvent::Prefill(p) => vec![p.first.token.id],
            DecodeEvent::Step(s) => s.committed.iter().map(|c| c.token.id).collect(),
            DecodeEvent::Finished(_) => Vec::new(),
        };
        for id in committed {
            if let Some(text) = detok.push(&loaded.tokenizer, id) {
                write!(out, "{text}")?;
            }
        }
        out.flush()?;
    }
    if !args.json {
        writeln!(out)?;
    }
    Ok(())
}
