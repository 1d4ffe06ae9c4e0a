//! A Kubernetes storage quantity (harvester_common::quantity::to_bytes).
//! The body is `harvester_common::fuzz::quantity`, which `cargo test` also runs over seed inputs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| harvester_common::fuzz::quantity(data));
