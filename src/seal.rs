//! Seals: an HMAC-SHA256 tag, made with the deployment key, over what Runner leaves in places
//! anyone with write access to Runner's subjects and buckets could also write to — partition
//! snapshots in the object store (`worker/ownership/snapshot.rs`) and control inputs in a
//! partition's inbox (`worker/control.rs`).
//!
//! The key is `security.deployment_key` or the first line of `security.deployment_key_file`.
//! Further lines of the file are earlier keys: they are still accepted, never used to seal,
//! so a key is rotated by putting the new one first on every node, then dropping the old
//! one once every node runs with the new file.
//!
//! Guarantees:
//! - **With a key**, everything sealed here carries a tag over every field that decides what
//!   it does, each field length-prefixed (no two field lists give the same bytes), and
//!   [`Seal::check`] accepts only a tag one of the keys made. Tags are compared in constant
//!   time.
//! - **Without a key** nothing is sealed and [`Seal::check`] accepts everything: the node
//!   says so once at start-up (a warning), and `/info` shows `sealed: false`.
//! - A key shorter than 16 bytes is refused at start-up, naming the setting.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// Shortest deployment key accepted, in bytes.
pub use crate::config::MIN_DEPLOYMENT_KEY_BYTES as MIN_KEY_BYTES;

/// The deployment's seal keys: the first seals, all of them check.
#[derive(Clone, Default)]
pub struct Seal {
    keys: std::sync::Arc<Vec<Vec<u8>>>,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the keys themselves.
        f.debug_struct("Seal")
            .field("keys", &self.keys.len())
            .finish()
    }
}

/// Why a seal was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// A key is configured and the thing carries no tag.
    #[error("it carries no seal, and this deployment requires one (security.deployment_key)")]
    Missing,
    /// The tag is not one any configured key made.
    #[error(
        "its seal was not made with this deployment's key (forged, altered, or from another deployment)"
    )]
    Wrong,
}

/// Why the keys could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The key file could not be read.
    #[error("security.deployment_key_file {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A key is too short, or the file holds none.
    #[error("{key}: {why}")]
    Invalid {
        /// The setting (and line).
        key: String,
        /// Why.
        why: String,
    },
}

impl Seal {
    /// No key: nothing is sealed, everything is accepted.
    pub fn none() -> Self {
        Self::default()
    }

    /// The keys of `security`: the inline key, else the lines of the key file (the first
    /// seals; blank lines and surrounding whitespace ignored).
    pub fn load(security: &crate::config::SecurityConfig) -> Result<Self, KeyError> {
        let (keys, origin): (Vec<String>, String) =
            match (&security.deployment_key, &security.deployment_key_file) {
                (Some(k), _) => (vec![k.trim().to_string()], "security.deployment_key".into()),
                (None, Some(path)) => {
                    let text = std::fs::read_to_string(path).map_err(|source| KeyError::Read {
                        path: path.display().to_string(),
                        source,
                    })?;
                    let keys: Vec<String> = text
                        .lines()
                        .map(str::trim)
                        .filter(|l| !l.is_empty())
                        .map(str::to_string)
                        .collect();
                    if keys.is_empty() {
                        return Err(KeyError::Invalid {
                            key: format!("security.deployment_key_file {}", path.display()),
                            why: "holds no key".into(),
                        });
                    }
                    (
                        keys,
                        format!("security.deployment_key_file {}", path.display()),
                    )
                }
                (None, None) => return Ok(Self::none()),
            };
        for (i, k) in keys.iter().enumerate() {
            if k.len() < MIN_KEY_BYTES {
                return Err(KeyError::Invalid {
                    key: format!("{origin} (key {})", i + 1),
                    why: format!("is shorter than {MIN_KEY_BYTES} bytes"),
                });
            }
        }
        Ok(Self {
            keys: std::sync::Arc::new(keys.into_iter().map(String::into_bytes).collect()),
        })
    }

    /// Keys given directly (tests).
    pub fn with_keys<K: AsRef<[u8]>>(keys: &[K]) -> Self {
        Self {
            keys: std::sync::Arc::new(keys.iter().map(|k| k.as_ref().to_vec()).collect()),
        }
    }

    /// Whether a key is configured.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// The tag of `fields` (lowercase hex) under the sealing key; `None` without a key.
    pub fn seal(&self, fields: &[&[u8]]) -> Option<String> {
        self.keys.first().map(|k| hex(&tag(k, fields)))
    }

    /// Accepts `tag` when a configured key made it over `fields`, or when no key is
    /// configured.
    pub fn check(&self, fields: &[&[u8]], tag_hex: Option<&str>) -> Result<(), Refused> {
        if self.keys.is_empty() {
            return Ok(());
        }
        let Some(given) = tag_hex else {
            return Err(Refused::Missing);
        };
        let given = given.as_bytes();
        let matches = self
            .keys
            .iter()
            .any(|k| constant_time_eq(hex(&tag(k, fields)).as_bytes(), given));
        if matches { Ok(()) } else { Err(Refused::Wrong) }
    }
}

/// HMAC-SHA256 under `key` of `fields`, each prefixed by its length.
fn tag(key: &[u8], fields: &[&[u8]]) -> [u8; 32] {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes a key of any length");
    for f in fields {
        mac.update(&(f.len() as u64).to_be_bytes());
        mac.update(f);
    }
    mac.finalize().into_bytes().into()
}

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        // RFC 4231 test case 2, through the same primitive (one field, no length prefix).
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn a_seal_checks_only_under_a_configured_key_and_for_the_same_fields() {
        let a = Seal::with_keys(&["a-key-of-sixteen-bytes"]);
        let t = a.seal(&[b"resume", b"acme"]).unwrap();
        assert_eq!(a.check(&[b"resume", b"acme"], Some(&t)), Ok(()));
        assert_eq!(
            a.check(&[b"resume", b"acme2"], Some(&t)),
            Err(Refused::Wrong)
        );
        // Length prefixes: moving a byte between fields changes the tag.
        assert_eq!(
            a.check(&[b"resum", b"eacme"], Some(&t)),
            Err(Refused::Wrong)
        );
        assert_eq!(a.check(&[b"resume", b"acme"], None), Err(Refused::Missing));
        let other = Seal::with_keys(&["another-key-sixteen-bytes"]);
        assert_eq!(
            other.check(&[b"resume", b"acme"], Some(&t)),
            Err(Refused::Wrong)
        );
        // Rotation: the new key seals, the old one still checks.
        let rotated = Seal::with_keys(&["another-key-sixteen-bytes", "a-key-of-sixteen-bytes"]);
        assert_eq!(rotated.check(&[b"resume", b"acme"], Some(&t)), Ok(()));
        assert_ne!(rotated.seal(&[b"resume", b"acme"]).unwrap(), t);
        // No key: nothing sealed, everything accepted.
        assert_eq!(Seal::none().seal(&[b"x"]), None);
        assert_eq!(Seal::none().check(&[b"x"], None), Ok(()));
    }

    #[test]
    fn short_keys_and_empty_files_are_refused_naming_the_setting() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("key");
        std::fs::write(&file, "a-new-key-of-enough-bytes\n\nshort\n").unwrap();
        let cfg = crate::config::SecurityConfig {
            deployment_key: None,
            deployment_key_file: Some(file.clone()),
        };
        let e = Seal::load(&cfg).unwrap_err().to_string();
        assert!(e.contains("key 2") && e.contains("shorter than 16"), "{e}");
        std::fs::write(&file, "\n  \n").unwrap();
        let e = Seal::load(&cfg).unwrap_err().to_string();
        assert!(e.contains("holds no key"), "{e}");
        std::fs::write(
            &file,
            "a-new-key-of-enough-bytes\nan-old-key-of-enough-bytes\n",
        )
        .unwrap();
        let s = Seal::load(&cfg).unwrap();
        assert_eq!(s.keys.len(), 2);
        assert!(format!("{s:?}").contains("keys: 2") && !format!("{s:?}").contains("enough"));
    }
}
