//! What the examples share: their exit status and error report, logging, and the driver
//! `EMM_DRIVER` picks.

use std::sync::Arc;

use driver_mock::{SimConfig, SimDriver};
use driver_sys::Driver;

use crate::setup::{Target, cuda_availability, make_driver};

/// Ends an example: on an error, prints its message (what happened and what to do) and every
/// cause not already in it, as a person should read it (not `Debug`), and exits with 1.
pub fn exit_with(result: Result<(), Box<dyn std::error::Error>>) -> std::process::ExitCode {
    let Err(e) = result else {
        return std::process::ExitCode::SUCCESS;
    };
    eprintln!("{}", error_report(&*e));
    std::process::ExitCode::FAILURE
}

/// Prints emm's tracing events to stderr as `EMM_LOG` filters them (`EMM_LOG=debug`); the
/// examples call it first.
pub fn log_from_env() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("EMM_LOG"))
        .init();
}

/// `error: <message>` and one `caused by:` line per source whose text the message does not
/// already contain.
pub fn error_report(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = format!("error: {e}");
    let mut source = e.source();
    while let Some(s) = source {
        let line = s.to_string();
        if !text.contains(&line) {
            text.push_str(&format!("\n  caused by: {line}"));
        }
        source = s.source();
    }
    text
}

/// Which driver `EMM_DRIVER` picks, and why.
#[derive(Debug)]
pub struct DriverChoice {
    /// The driver.
    pub driver: Arc<dyn Driver>,
    /// Whether it is the simulator.
    pub simulated: bool,
    /// Why this driver was chosen (for the user).
    pub reason: String,
}

/// The driver `EMM_DRIVER` asks for: `cuda` (the GPU, or an error), `sim` (the simulator), or
/// `auto` (default: the GPU where one is usable, otherwise the simulator, saying why).
pub fn driver_from_env() -> Result<DriverChoice, String> {
    let mode = std::env::var("EMM_DRIVER").unwrap_or_else(|_| "auto".into());
    let sim = || DriverChoice {
        driver: Arc::new(SimDriver::new(SimConfig::default())),
        simulated: true,
        reason: String::new(),
    };
    match mode.trim() {
        "sim" => Ok(DriverChoice {
            reason: "EMM_DRIVER=sim".into(),
            ..sim()
        }),
        "cuda" => cuda_driver().map_err(|e| {
            format!("EMM_DRIVER=cuda, but {e} (EMM_DRIVER=sim runs the examples on the simulator)")
        }),
        "auto" | "" => Ok(cuda_driver().unwrap_or_else(|why| DriverChoice {
            reason: format!("no usable GPU ({why})"),
            ..sim()
        })),
        other => Err(format!(
            "EMM_DRIVER={other:?} is invalid: use auto, sim or cuda (or unset it)"
        )),
    }
}

fn cuda_driver() -> Result<DriverChoice, String> {
    cuda_availability()?;
    let (driver, _) = make_driver(Target::Cuda).map_err(|e| e.to_string())?;
    Ok(DriverChoice {
        driver,
        simulated: false,
        reason: "a CUDA GPU is present".into(),
    })
}
