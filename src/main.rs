//! The `pagedattn` command line: the demo (default), the simulator and the benchmark.

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "pagedattn", version, about = "PagedAttention on any GPU")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Multi-tenant paged-KV memory simulator: paged vs contiguous policies.
    Simulate(pagedattn::sim::SimulateArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Some(Command::Simulate(args)) => pagedattn::sim::run_cli(&args),
        None => Ok(()),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
