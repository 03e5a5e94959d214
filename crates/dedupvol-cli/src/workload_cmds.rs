//! (being written)
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum WorkloadCommand {
    /// (being written)
    GenPlaceholder,
}

impl WorkloadCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        anyhow::bail!("not yet implemented")
    }
}
