//! A monotonic clock for the server's step timings: `std::time::Instant`
//! natively; in a browser (where `std` has no clock) the page's
//! millisecond clock.

#[cfg(not(target_arch = "wasm32"))]
pub use std::time::Instant;

#[cfg(target_arch = "wasm32")]
#[derive(Clone, Copy, Debug)]
pub struct Instant(f64);

#[cfg(target_arch = "wasm32")]
impl Instant {
    pub fn now() -> Self {
        Self(js_sys::Date::now())
    }

    pub fn elapsed(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(((js_sys::Date::now() - self.0) / 1e3).max(0.0))
    }
}
