//! (being written)
use clap::Subcommand;
use std::process::ExitCode;

#[derive(Subcommand)]
pub enum ServeCommand {
    /// (being written)
    ServePlaceholder,
}

impl ServeCommand {
    pub fn run(self) -> anyhow::Result<ExitCode> {
        anyhow::bail!("not yet implemented")
    }
}
