//! The `spex` binary: parses the command line and reports errors as one line.

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = spex::cli::Cli::parse();
    match spex::cli::run(cli) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("spex: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
