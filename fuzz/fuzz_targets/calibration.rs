//! Fuzzes the quantization calibration checks and helpers; see
//! tests/common/calibration.rs for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/common/calibration.rs"]
mod calibration;

fuzz_target!(|data: &[u8]| {
    calibration::run(data);
});
