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
    // After parsing (`--help` and bad flags start no pool), before anything starts a thread.
    pin_candle_threads();
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
/// kernel, which then zeroes fresh pages on the next step. Keeping them made training much
/// faster and `spex bench`'s baseline and SPEED a little faster (two interleaved runs each).
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

/// Asks candle once how many threads its CPU matmuls use. candle 0.11 asks on every matmul,
/// and without `RAYON_NUM_THREADS` its answer reads `/proc/cpuinfo` (`num_cpus::get_physical`)
/// each time: a file read and parse on every product, on every candle op path on the CPU
/// (bf16 and f16 models, training), which made `spex generate --dtype bf16 --max-tokens 64
/// --policy baseline` far slower. Its answer goes into the variable, which candle reads
/// instead; rayon's pool is then built at the size it would have chosen without the variable,
/// so only candle's repeated question changes.
fn pin_candle_threads() {
    if std::env::var_os("RAYON_NUM_THREADS").is_some() {
        return;
    }
    let candle = candle_core::utils::get_num_threads();
    // SAFETY: nothing else reads or writes the environment: no thread has started yet.
    unsafe { std::env::set_var("RAYON_NUM_THREADS", candle.to_string()) };
    let logical = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    // Fails only if a pool exists already, which then keeps its size.
    let _ = rayon::ThreadPoolBuilder::new()
        .num_threads(logical)
        .build_global();
}
