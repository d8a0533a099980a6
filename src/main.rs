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
    let cli = spex::cli::Cli::parse();
    match spex::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spex: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
