//! One test suite, two targets.
//!
//! Suite tests are written once against a [`TestCtx`] and instantiated for every available
//! [`Target`]: the simulator always, the real CUDA driver when a GPU is present. Test names
//! carry the target (`sim::alloc_write_read_free`, `cuda::alloc_write_read_free`).
//!
//! | variable | values | effect |
//! | --- | --- | --- |
//! | `EMM_TEST_TARGET` | `all` (default), `sim`, `cuda` | which targets the suite runs on |
//! | `EMM_REQUIRE_GPU` | `1` | a missing GPU fails the run instead of skipping the CUDA tests |
//! | `EMM_REQUIRE_GPUS` | `2` | fewer than two GPUs fails the run instead of skipping the multi-device tests |
//! | `EMM_STRESS_OPS` | a number (default 32 000) | operations of the stress test |
//! | `EMM_DRIVER` | `auto` (default), `sim`, `cuda` | which driver [`driver_from_env`] picks (examples) |

mod examples_support;
mod ipc;
mod setup;
pub mod stress;
pub mod traces;

pub use examples_support::*;
pub use ipc::*;
pub use setup::*;

#[cfg(test)]
mod tests {
    use super::ipc::child_result;
    use super::{error_report, parse_count, parse_flag};

    #[cfg(unix)]
    #[test]
    fn the_child_result_line_is_read_back() {
        use std::os::unix::process::ExitStatusExt;
        let output = |stdout: &str, code: i32| std::process::Output {
            status: std::process::ExitStatus::from_raw(code << 8),
            stdout: stdout.as_bytes().to_vec(),
            stderr: b"boom".to_vec(),
        };
        // The raw importer reports success with no bytes; the IPC child with what it read.
        assert_eq!(child_result(&output("EMM_IPC_RESULT ok \n", 0)), Ok(vec![]));
        assert_eq!(
            child_result(&output("noise\nEMM_IPC_RESULT ok 07ff\n", 0)),
            Ok(vec![7, 255])
        );
        assert_eq!(
            child_result(&output("EMM_IPC_RESULT err no such pool\n", 0)),
            Err("in the child process: no such pool".to_string())
        );
        let crashed = child_result(&output("", 3)).unwrap_err();
        assert!(
            crashed.contains("printed no result (exit Some(3))"),
            "{crashed}"
        );
        assert!(crashed.contains("boom"), "{crashed}");
        let garbled = child_result(&output("EMM_IPC_RESULT maybe\n", 0)).unwrap_err();
        assert!(garbled.starts_with("unreadable child result"), "{garbled}");
    }

    #[test]
    fn malformed_test_variables_are_refused_by_name() {
        assert_eq!(parse_flag("EMM_X", None), Ok(false));
        assert_eq!(parse_flag("EMM_X", Some(" YES ")), Ok(true));
        assert_eq!(parse_flag("EMM_X", Some("0")), Ok(false));
        for bad in ["", "2", "maybe", "on"] {
            let e = parse_flag("EMM_X", Some(bad)).unwrap_err();
            assert!(e.starts_with("EMM_X="), "{e}");
            assert!(e.contains("unset it"), "{e}");
        }
        assert_eq!(parse_count("EMM_N", None, 32_000, 1), Ok(32_000));
        assert_eq!(
            parse_count("EMM_N", Some("1_000_000"), 32_000, 1),
            Ok(1_000_000)
        );
        for bad in ["", "-1", "1.5", "lots", "0"] {
            let e = parse_count("EMM_N", Some(bad), 32_000, 1).unwrap_err();
            assert!(e.starts_with("EMM_N="), "{e}");
        }
        assert_eq!(parse_count("EMM_N", Some("0"), 0, 0), Ok(0));
    }

    #[test]
    fn error_report_prints_each_cause_once() {
        let driver = driver_sys::DriverError::from_code("cuMemAlloc", 2);
        let e = emm::EmmError::driver("memalloc", driver_sys::DeviceOrdinal(0), driver.clone());
        let text = error_report(&e);
        assert!(text.starts_with("error: memalloc on device 0"), "{text}");
        assert_eq!(
            text.matches("CUDA_ERROR_OUT_OF_MEMORY").count(),
            1,
            "the driver's error is printed once: {text}"
        );
        let io = std::io::Error::other("disk full");
        let wrapped = emm::EmmError::PoolTransfer {
            what: "sending a pool export",
            error: io,
        };
        let text = error_report(&wrapped);
        assert!(text.contains("disk full"), "{text}");
    }
}
