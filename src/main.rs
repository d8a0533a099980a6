//! The `spex` binary: parses the command line and reports errors as one line.

use clap::Parser;

fn main() -> std::process::ExitCode {
    // Like other Unix filters: a closed pipe (`spex bench | head`) ends the process quietly
    // instead of failing a print.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    tune_malloc();
    let cli = match spex::cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if !e.use_stderr() => e.exit(), // --help, --version: print and succeed
        Err(e) => {
            // clap's message is its first line; the rest is a blank line and a hint.
            let rendered = e.to_string();
            let line = rendered.lines().next().unwrap_or("invalid arguments");
            eprintln!("spex: {} (see --help)", line.trim_start_matches("error: "));
            return std::process::ExitCode::from(2);
        }
    };
    match spex::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spex: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Keeps freed memory in the process. Training (candle) and decoding (spex's kernels) allocate
/// and free buffers every step, and glibc's defaults hand the top of the heap back to the
/// kernel, which then zeroes fresh pages on the next step. Measured: training 270 → 450
/// tokens/s; `spex bench` baseline 433–439 → 447–451 tok/s and SPEED 842–860 → 880–900 tok/s
/// (two interleaved runs each).
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes allocator thresholds; called before anything allocates
    // much and before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
        libc::mallopt(libc::M_TOP_PAD, 1 << 30);
    }
}
