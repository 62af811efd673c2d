//! A real headless browser for tests: Debian's `chromium` driven over the W3C WebDriver
//! protocol through `chromedriver` (Debian's `chromium-driver`), with plain HTTP calls.
//!
//! Every wait polls the page until a condition holds or a generous deadline passes; nothing
//! sleeps a guessed time. When the [`Browser`] is dropped its session is ended (Chromium
//! quits) and the driver process is killed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value as Json, json};

/// The key WebDriver names element references with.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

fn find_tool(names: &[&str]) -> PathBuf {
    for dir in std::env::var("PATH").unwrap_or_default().split(':') {
        for n in names {
            let p = Path::new(dir).join(n);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "none of {names:?} found: install Debian's `chromium` and `chromium-driver` \
         (scripts/setup-deps --test)"
    );
}

/// One browser session.
pub struct Browser {
    driver: Child,
    base: String,
    http: reqwest::Client,
}

impl Drop for Browser {
    fn drop(&mut self) {
        // End the session first, so chromedriver quits Chromium: killing the driver alone
        // leaves Chromium running, its page still polling. A plain request, as Drop cannot
        // await.
        if let Some(rest) = self.base.strip_prefix("http://") {
            use std::io::{Read, Write};
            if let Some((host, path)) = rest.split_once('/')
                && let Ok(mut tcp) = std::net::TcpStream::connect(host)
            {
                let _ = tcp.set_read_timeout(Some(Duration::from_secs(10)));
                let _ = write!(
                    tcp,
                    "DELETE /{path} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                let _ = tcp.read(&mut [0u8; 512]);
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

impl Browser {
    /// Starts chromedriver on a free port and a headless Chromium session.
    pub async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new(find_tool(&["chromedriver"]))
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let http = reqwest::Client::new();
        let root = format!("http://127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = http.get(format!("{root}/status")).send().await;
            if let Ok(r) = ready
                && let Ok(v) = r.json::<Json>().await
                && v["value"]["ready"] == true
            {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "chromedriver did not become ready"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let chromium = find_tool(&["chromium", "chromium-browser"]);
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                         "--disable-dev-shm-usage", "--window-size=1280,1000"]
            }
        }}});
        let v: Json = http
            .post(format!("{root}/session"))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let session = v["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {v}"))
            .to_string();
        Self {
            driver,
            base: format!("{root}/session/{session}"),
            http,
        }
    }

    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Json>) -> Json {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(b) = body {
            req = req.json(&b);
        }
        let v: Json = req.send().await.unwrap().json().await.unwrap();
        v["value"].clone()
    }

    /// Opens `url`.
    pub async fn goto(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` in the page with `args`; returns its result.
    pub async fn script(&self, script: &str, args: Json) -> Json {
        self.call(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    async fn element(&self, css: &str) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let v = self
                .call(
                    reqwest::Method::POST,
                    "/element",
                    Some(json!({ "using": "css selector", "value": css })),
                )
                .await;
            if let Some(id) = v[ELEMENT].as_str() {
                return id.to_string();
            }
            assert!(Instant::now() < deadline, "no element {css} on the page");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Replaces the value of the input `css` with `text`.
    pub async fn fill(&self, css: &str, text: &str) {
        let id = self.element(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/clear"),
            Some(json!({})),
        )
        .await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Clicks `css`.
    pub async fn click(&self, css: &str) {
        let id = self.element(css).await;
        self.call(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            Some(json!({})),
        )
        .await;
    }

    /// The text of every element matching `css`.
    pub async fn texts(&self, css: &str) -> Vec<String> {
        let v = self
            .script(
                "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.textContent);",
                json!([css]),
            )
            .await;
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|t| t.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    }
    /// A PNG of the page as it is now (WebDriver's screenshot of the window).
    pub async fn screenshot(&self) -> Vec<u8> {
        let v = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let text = v.as_str().unwrap_or_else(|| panic!("no screenshot: {v}"));
        base64_decode(text)
    }

    /// Waits until `check` holds for the texts of `css`; returns them.
    pub async fn wait_for(
        &self,
        css: &str,
        what: &str,
        check: impl Fn(&[String]) -> bool,
    ) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let t = self.texts(css).await;
            if check(&t) {
                return t;
            }
            assert!(Instant::now() < deadline, "{what}: {css} shows {t:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Standard base64 (WebDriver's screenshot encoding) to bytes.
fn base64_decode(text: &str) -> Vec<u8> {
    let value = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:?}"),
        }
    };
    let clean: Vec<u8> = text
        .bytes()
        .filter(|c| !c.is_ascii_whitespace() && *c != b'=')
        .collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= value(*c) << (18 - 6 * i);
        }
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..chunk.len()]);
    }
    out
}
