//! The cloud-config token's JWT `exp` (harvester_common::cloud_config::jwt_expiry).
//! The body is `harvester_common::fuzz::jwt_expiry`, which `cargo test` also runs over seed inputs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| harvester_common::fuzz::jwt_expiry(data));
