//! The `url` of an `http` effect: what the input may change in it, and how its values are
//! written there.
//!
//! A URL template mixes literal text with `${ expr }` holes. A hole whose expression reads
//! only `saga.secrets` (or nothing) is the operator's: its value is written as it is, like
//! literal text. Any other hole is input (it reads the command, which carries what events
//! and state put there) and is written according to where it stands:
//!
//! | where | how an input value is written |
//! |---|---|
//! | path | percent-encoded whole (`/`, `?`, `#`, `%` included), so it stays one segment; a value that is exactly `.` or `..` is refused (it would name another path) |
//! | query, fragment | percent-encoded whole (`&`, `=`, `#`, `+` included), so it stays one value |
//! | scheme, host or port | only with `allowed_hosts`: written as it is, and the URL must then be `http` or `https`, carry no user or password, and name one of the listed hosts |
//!
//! Guarantees: without `allowed_hosts`, the scheme, host and port of every request are the
//! ones the manifest and the operator's secrets give; a template whose input could change
//! them is refused when the manifest is loaded (`runner validate` names the setting). No
//! input value can add a path segment, a query parameter or a fragment. With
//! `allowed_hosts`, every request goes to a listed host (`host`: on the scheme's default
//! port; `host:port`: on that port).

use serde_json::Value as Json;

use crate::expr::{Expr, Piece, Template, Vars};

/// Where in a URL the text written so far ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pos {
    /// Before `://`.
    Scheme,
    /// After `://`, before the path.
    Authority,
    /// Somewhere the operator's value decides (compile time only).
    Unknown,
    Path,
    Query,
    Fragment,
}

/// Follows text through a URL's parts.
#[derive(Debug, Clone, Copy)]
struct Scan {
    pos: Pos,
    /// Consecutive `:`, `/` characters seen while in the scheme (`://` ends it).
    sep: u8,
}

impl Scan {
    fn new() -> Self {
        Self {
            pos: Pos::Scheme,
            sep: 0,
        }
    }

    fn feed(&mut self, text: &str) {
        for c in text.chars() {
            self.pos = match (self.pos, c) {
                (Pos::Scheme, ':') if self.sep == 0 => {
                    self.sep = 1;
                    Pos::Scheme
                }
                (Pos::Scheme, '/') if self.sep == 1 || self.sep == 2 => {
                    self.sep += 1;
                    if self.sep == 3 {
                        Pos::Authority
                    } else {
                        Pos::Scheme
                    }
                }
                (Pos::Scheme, _) => {
                    self.sep = 0;
                    Pos::Scheme
                }
                (Pos::Authority | Pos::Unknown, '/') => Pos::Path,
                (Pos::Authority | Pos::Unknown | Pos::Path, '?') => Pos::Query,
                (Pos::Authority | Pos::Unknown | Pos::Path | Pos::Query, '#') => Pos::Fragment,
                (p, _) => p,
            };
        }
    }

    /// Where an input value written now would stand in the authority (or before it).
    fn in_authority(&self) -> bool {
        matches!(self.pos, Pos::Scheme | Pos::Authority | Pos::Unknown)
    }
}

#[derive(Debug, Clone)]
enum Part {
    Text(String),
    /// The operator's: reads only `saga.secrets`, or nothing.
    Trusted(Expr),
    /// Reads the command.
    Input(Expr),
}

/// A host a URL whose authority comes from input may name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Allowed {
    host: String,
    port: Option<u16>,
}

/// A compiled `url` setting (see the module doc).
#[derive(Debug, Clone)]
pub struct UrlTemplate {
    parts: Vec<Part>,
    allowed: Vec<Allowed>,
}

fn trusted(e: &Expr) -> bool {
    e.needs().reads_only_secrets()
}

impl UrlTemplate {
    /// Compiles `template` with the `allowed_hosts` list, if given. The error is the
    /// message for the `url` (or `allowed_hosts`) setting.
    pub fn compile(template: Template, allowed_hosts: &[String]) -> Result<Self, String> {
        let parts = match template {
            Template::Literal(Json::String(s)) => vec![Part::Text(s)],
            Template::Expr(e) => vec![if trusted(&e) {
                Part::Trusted(e)
            } else {
                Part::Input(e)
            }],
            Template::Interpolate(pieces) => pieces
                .into_iter()
                .map(|p| match p {
                    Piece::Text(t) => Part::Text(t),
                    Piece::Expr(e) if trusted(&e) => Part::Trusted(e),
                    Piece::Expr(e) => Part::Input(e),
                })
                .collect(),
            _ => return Err("must be a string".into()),
        };
        let allowed = allowed_hosts
            .iter()
            .map(|h| parse_allowed(h))
            .collect::<Result<Vec<_>, _>>()?;
        let mut scan = Scan::new();
        for p in &parts {
            match p {
                Part::Text(t) => scan.feed(t),
                Part::Trusted(_) if scan.in_authority() => scan.pos = Pos::Unknown,
                Part::Trusted(_) => {}
                Part::Input(e) if scan.in_authority() && allowed.is_empty() => {
                    return Err(format!(
                        "the scheme, host or port could come from the input (`${{ {} }}`): write \
                         them in the template (or take them from a secret), or list the hosts \
                         the input may name in `allowed_hosts`",
                        e.source()
                    ));
                }
                Part::Input(_) => {}
            }
        }
        Ok(Self { parts, allowed })
    }

    /// The URL for one request. The error says what is wrong without the URL itself (it
    /// may hold a secret).
    pub fn render(&self, vars: &Vars<'_>) -> Result<String, String> {
        let mut out = String::new();
        let mut scan = Scan::new();
        for p in &self.parts {
            match p {
                Part::Text(t) => {
                    out.push_str(t);
                    scan.feed(t);
                }
                Part::Trusted(e) => {
                    let v = text(e.eval(vars).map_err(|e| e.to_string())?);
                    out.push_str(&v);
                    scan.feed(&v);
                }
                Part::Input(e) => {
                    let v = text(e.eval(vars).map_err(|e| e.to_string())?);
                    match scan.pos {
                        Pos::Path if v == "." || v == ".." => {
                            return Err(format!(
                                "`${{ {} }}` is `{v}`, which would name another path",
                                e.source()
                            ));
                        }
                        Pos::Path | Pos::Query | Pos::Fragment => encode(&v, &mut out),
                        // Only with `allowed_hosts` (checked at compile time); the host is
                        // checked below.
                        Pos::Scheme | Pos::Authority | Pos::Unknown => {
                            out.push_str(&v);
                            scan.feed(&v);
                        }
                    }
                }
            }
        }
        if !self.allowed.is_empty() {
            self.check_host(&out)?;
        }
        Ok(out)
    }

    fn check_host(&self, url: &str) -> Result<(), String> {
        let u = reqwest::Url::parse(url).map_err(|e| format!("not a URL: {e}"))?;
        if u.scheme() != "http" && u.scheme() != "https" {
            return Err(format!("scheme `{}` is not http or https", u.scheme()));
        }
        if !u.username().is_empty() || u.password().is_some() {
            return Err("a URL with a user or password is refused".into());
        }
        let host = u.host_str().unwrap_or_default().to_ascii_lowercase();
        let port = u.port_or_known_default();
        let default = match u.scheme() {
            "https" => Some(443),
            _ => Some(80),
        };
        let ok = self
            .allowed
            .iter()
            .any(|a| a.host == host && a.port.or(default) == port);
        if ok {
            Ok(())
        } else {
            Err(format!(
                "host `{host}` (port {}) is not in `allowed_hosts`",
                port.map_or("none".into(), |p| p.to_string())
            ))
        }
    }
}

fn parse_allowed(entry: &str) -> Result<Allowed, String> {
    let bad = || format!("`allowed_hosts`: `{entry}` is not `host` or `host:port`");
    let (host, port) = match entry.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') => (h, Some(p.parse::<u16>().map_err(|_| bad())?)),
        Some(_) => return Err(bad()),
        None => (entry, None),
    };
    let valid = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !valid {
        return Err(bad());
    }
    Ok(Allowed {
        host: host.to_ascii_lowercase(),
        port,
    })
}

fn text(v: Json) -> String {
    match v {
        Json::String(s) => s,
        other => other.to_string(),
    }
}

/// Percent-encodes every byte of `v` but the unreserved characters (RFC 3986 §2.3).
fn encode(v: &str, out: &mut String) {
    for b in v.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn url(t: &str, hosts: &[&str]) -> Result<UrlTemplate, String> {
        let hosts: Vec<String> = hosts.iter().map(|h| h.to_string()).collect();
        UrlTemplate::compile(Template::compile_str(t).expect("a template"), &hosts)
    }

    fn render(t: &UrlTemplate, payload: Json) -> Result<String, String> {
        let event = json!({"payload": payload});
        let saga = json!({"secrets": {"base": "http://bureau.internal:8080"}});
        let state = json!({});
        t.render(&Vars::new(&event, &state, &saga))
    }

    #[test]
    fn input_in_a_path_or_query_stays_one_segment_or_value() {
        let t = url(
            "http://shop.internal/v1/customers/${ event.payload.id }/orders?q=${ event.payload.q }#${ event.payload.f }",
            &[],
        )
        .expect("compiles");
        let u = render(
            &t,
            json!({"id": "../../admin/purge?all=true#", "q": "a&b=c d", "f": "x#y"}),
        )
        .expect("renders");
        assert_eq!(
            u,
            "http://shop.internal/v1/customers/..%2F..%2Fadmin%2Fpurge%3Fall%3Dtrue%23/orders?q=a%26b%3Dc%20d#x%23y"
        );
        let parsed = reqwest::Url::parse(&u).expect("a URL");
        assert_eq!(
            parsed.path(),
            "/v1/customers/..%2F..%2Fadmin%2Fpurge%3Fall%3Dtrue%23/orders"
        );
        assert_eq!(parsed.host_str(), Some("shop.internal"));
        for dots in [".", ".."] {
            let why = render(&t, json!({"id": dots, "q": "", "f": ""})).expect_err("refused");
            assert!(why.contains("another path"), "{why}");
        }
        // `%2e%2e` is written as `%252e%252e`: not a dot segment.
        let u = render(&t, json!({"id": "%2e%2e", "q": "", "f": ""})).expect("renders");
        assert!(u.contains("/customers/%252e%252e/orders"), "{u}");
        // Numbers and other values are written as JSON text, encoded.
        let u = render(&t, json!({"id": 42, "q": [1], "f": null})).expect("renders");
        assert!(u.ends_with("/customers/42/orders?q=%5B1%5D#null"), "{u}");
    }

    #[test]
    fn input_that_could_change_the_authority_is_refused_without_a_host_list() {
        for t in [
            "${ event.payload.callback }",
            "http://${ event.payload.host }/x",
            "http://shop.internal${ event.payload.p }",
            "${ event.payload.scheme }://shop.internal/x",
            "${ saga.secrets.base }${ event.payload.p }",
        ] {
            let why = url(t, &[]).expect_err(t);
            assert!(why.contains("allowed_hosts"), "{t}: {why}");
        }
        // The operator's secret may give the scheme, host and port.
        let t = url(
            "${ saga.secrets.base }/v1/scores/${ event.payload.id }",
            &[],
        )
        .expect("ok");
        assert_eq!(
            render(&t, json!({"id": "a/b"})).expect("renders"),
            "http://bureau.internal:8080/v1/scores/a%2Fb"
        );
        // A query right after the host is past the authority.
        assert!(url("http://shop.internal?id=${ event.payload.id }", &[]).is_ok());
    }

    #[test]
    fn with_a_host_list_only_listed_hosts_are_called() {
        let t = url(
            "${ event.payload.callback }",
            &["hooks.example.com", "127.0.0.1:9000"],
        )
        .expect("compiles");
        let ok = |u: &str| render(&t, json!({"callback": u}));
        assert!(ok("https://hooks.example.com/a?b=c").is_ok());
        assert!(ok("http://HOOKS.example.com/a").is_ok());
        assert!(ok("http://127.0.0.1:9000/x").is_ok());
        for bad in [
            "http://127.0.0.1:8080/admin/drain",
            "http://127.0.0.1/x",
            "https://hooks.example.com:8443/a",
            "http://evil.example/",
            "http://user:pw@hooks.example.com/",
            "file:///etc/passwd",
            "not a url",
        ] {
            assert!(ok(bad).is_err(), "{bad}");
        }
        for bad_entry in ["", "a/b", "h:port", "a b", "[::1]:80"] {
            assert!(
                url("${ event.payload.callback }", &[bad_entry]).is_err(),
                "{bad_entry}"
            );
        }
    }
}
