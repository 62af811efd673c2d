//! Fuzz target: `runner::fuzz::storage_codecs` (see that function for the properties it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| runner::fuzz::storage_codecs(data));
