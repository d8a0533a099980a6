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
