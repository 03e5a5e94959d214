//! The `dedupvol` command-line tool: format, inspect, check, import/export, serve and
//! benchmark volumes.

mod probe;
mod serve;
mod volume_cmds;
mod workload_cmds;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "dedupvol", version, about = "Inline dedup + compression block storage engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    #[command(flatten)]
    Volume(volume_cmds::VolumeCommand),
    #[command(flatten)]
    Serve(serve::ServeCommand),
    #[command(flatten)]
    Workload(workload_cmds::WorkloadCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Volume(c) => c.run(),
        Command::Serve(c) => c.run(),
        Command::Workload(c) => c.run(),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dedupvol: error: {e:#}");
            ExitCode::from(1)
        }
    }
}
