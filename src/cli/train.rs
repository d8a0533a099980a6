//! `spex train`: runs the engine's trainer with an indicatif progress bar (loss per pass,
//! tokens/s, ETA) and stops cleanly, with a checkpoint, on Ctrl-C.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::engine::kernels::SubnormalsFlushed;
use crate::train::{Progress, Trainer};

/// `spex train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Training config (TOML: [model] shape, [train] settings).
    #[arg(long)]
    pub config: PathBuf,
    /// Corpus text files.
    #[arg(long, num_args = 1.., required = true)]
    pub corpus: Vec<PathBuf>,
    /// Output checkpoint directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Continue the run saved in --out.
    #[arg(long)]
    pub resume: bool,
    /// Stop after this many steps in this invocation (the run can be resumed).
    #[arg(long)]
    pub max_steps_now: Option<usize>,
}

fn describe(p: &Progress) -> String {
    let losses: Vec<String> = p.loss_per_pass.iter().map(|l| format!("{l:.3}")).collect();
    let mut msg = format!(
        "loss/pass [{}] lr {:.1e} {:.0} tok/s",
        losses.join(" "),
        p.lr,
        p.tokens_per_sec
    );
    if let Some(v) = &p.validation {
        let agree: Vec<String> = v
            .agreement_with_last
            .iter()
            .map(|a| format!("{:.0}%", a * 100.0))
            .collect();
        let losses: Vec<String> = v.loss_per_pass.iter().map(|l| format!("{l:.3}")).collect();
        msg.push_str(&format!(
            " | val [{}] agree [{}]",
            losses.join(" "),
            agree.join(" ")
        ));
    }
    msg
}

pub fn run(args: &TrainArgs) -> anyhow::Result<()> {
    // Subnormal gradients and moments appear as training converges; rayon's and candle's
    // threads, spawned after this, inherit the mode.
    let _flushed = SubnormalsFlushed::enter();
    let mut trainer = Trainer::prepare(&args.config, &args.corpus, &args.out, args.resume)?;
    let corpus = trainer.corpus();
    let c = trainer.model_config();
    eprintln!(
        "spex train: {} training / {} held-out tokens, model hidden {} · K={} R={} · {} heads \
         ({} kv) · vocab {}",
        corpus.train.len(),
        corpus.validation.len(),
        c.hidden,
        c.layers,
        c.passes,
        c.heads,
        c.kv_heads,
        c.vocab
    );
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        // Ctrl-C: finish the step, save, exit.
        let _ = ctrlc_handler(move || stop.store(true, Ordering::SeqCst));
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:30} {pos}/{len} [{elapsed_precise} eta {eta_precise}] {msg}",
        )
        .expect("static progress template: this is a bug"),
    );
    let limit = args.max_steps_now.unwrap_or(usize::MAX);
    let mut done_now = 0usize;
    let last = trainer.run(
        |p| {
            done_now += 1;
            bar.set_length(p.steps as u64);
            bar.set_position(p.step as u64);
            bar.set_message(describe(p));
            if p.validation.is_some() {
                // A hidden bar (no terminal, e.g. a log file) prints nothing: write directly.
                if bar.is_hidden() {
                    eprintln!("step {}: {}", p.step, describe(p));
                } else {
                    bar.println(format!("step {}: {}", p.step, describe(p)));
                }
            }
            if done_now >= limit {
                stop.store(true, Ordering::SeqCst);
            }
        },
        || stop.load(Ordering::SeqCst),
    )?;
    bar.finish();
    eprintln!(
        "spex train: saved {} at step {}/{}: {}",
        args.out.display(),
        last.step,
        last.steps,
        describe(&last)
    );
    Ok(())
}

/// Installs a SIGINT handler without an extra crate (Linux); elsewhere Ctrl-C just exits.
fn ctrlc_handler(f: impl Fn() + Send + Sync + 'static) -> Option<()> {
    #[cfg(unix)]
    {
        use std::sync::OnceLock;
        static HANDLER: OnceLock<Box<dyn Fn() + Send + Sync>> = OnceLock::new();
        extern "C" fn on_sigint(_: libc::c_int) {
            if let Some(h) = HANDLER.get() {
                h();
            }
        }
        HANDLER.set(Box::new(f)).ok()?;
        // SAFETY: the handler only stores to an atomic through the closure.
        unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
        Some(())
    }
    #[cfg(not(unix))]
    {
        let _ = f;
        None
    }
}
