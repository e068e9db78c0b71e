//! Fuzzes the quantization calibration checks and helpers; see
//! test-support/src/calibration.rs for the input format and what is checked.
#![no_main]

use libfuzzer_sys::fuzz_target;

use pagedattn_test_support::calibration;

fuzz_target!(|data: &[u8]| {
    calibration::run(data);
});
