//! What the integration suites in `tests/tests` share: the products running in-process against a
//! bed and the helpers several suites call. Rule: a suite helper lives here (not in a
//! `tests/tests/*_common.rs` file or a local copy); it may use every other layer, and nothing
//! else in the library uses it.

pub mod chaos;
pub mod csi;
pub mod deploy;
pub mod service_controller;
