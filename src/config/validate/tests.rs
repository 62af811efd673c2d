//! Validation errors name their key, and the defaults pass.

use super::*;

#[test]
fn defaults_are_valid() {
    Config::default().validate().expect("defaults validate");
}

#[test]
fn out_of_range_names_the_key() {
    let mut c = Config::default();
    c.streams.replicas = 7;
    match c.validate() {
        Err(ConfigError::Invalid { key, .. }) => assert_eq!(key, "streams.replicas"),
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn an_effect_byte_budget_out_of_range_names_the_key_and_the_range() {
    for bytes in [ByteSize(512 * 1024), ByteSize::gib(17)] {
        let mut c = Config::default();
        c.effect.max_inflight_bytes = bytes;
        match c.validate() {
            Err(ConfigError::Invalid { key, message }) => {
                assert_eq!(key, "effect.max_inflight_bytes");
                assert!(message.contains("1MiB to 16GiB"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[test]
fn a_page_size_not_a_power_of_two_from_4kib_to_64kib_names_the_key() {
    for bytes in [ByteSize(2048), ByteSize(12 * 1024), ByteSize::kib(128)] {
        let mut c = Config::default();
        c.storage.page_size = bytes;
        match c.validate() {
            Err(ConfigError::Invalid { key, message }) => {
                assert_eq!(key, "storage.page_size");
                assert!(message.contains(&bytes.to_string()), "{message}");
                assert!(message.contains("4KiB to 64KiB"), "{message}");
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    for kib in [4, 8, 16, 32, 64] {
        let mut c = Config::default();
        c.storage.page_size = ByteSize::kib(kib);
        c.validate().expect("a power of two in range");
    }
}

#[test]
fn async_threads_are_half_the_cores_unless_set_and_a_count_out_of_range_names_the_key() {
    let mut c = Config::default();
    assert_eq!(
        [1, 2, 3, 8].map(|cores| c.runner.async_threads(cores)),
        [1, 1, 1, 4]
    );
    c.runner.worker_threads = 3;
    assert_eq!(c.runner.async_threads(2), 3);
    c.runner.worker_threads = 1025;
    match c.validate() {
        Err(ConfigError::Invalid { key, message }) => {
            assert_eq!(key, "runner.worker_threads");
            assert!(message.contains("0 to 1024"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}
