//! A datagram received on the DHCP client port (harvester_dhcp::wire::parse_reply and the
//! exchange state machine).
//! The body is `harvester_dhcp::fuzz::dhcp_reply`, which `cargo test` also runs over seed inputs.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    harvester_dhcp::fuzz::dhcp_reply(data);
});
