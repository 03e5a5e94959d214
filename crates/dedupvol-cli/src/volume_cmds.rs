//! (being written)
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum VolumeCommand {
    /// (being written)
    InfoPlaceholder,
}

impl VolumeCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        anyhow::bail!("not yet implemented")
    }
}
