//! Placeholder: the simulator is being written.
#[derive(clap::Args, Debug)]
pub struct SimulateArgs {}
pub fn run_cli(_a: &SimulateArgs) -> Result<(), Box<dyn std::error::Error>> {
    Ok(())
}
