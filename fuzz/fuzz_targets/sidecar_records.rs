//! The sidecar's record decoder (`vramcap sidecar`, docs/sidecar-protocol.md): what a client
//! sends after connecting — a header line, then event/usage/summary lines — is untrusted. Lines
//! that parse as JSON objects go through `Client::from_header` (the first) and `Client::apply`
//! (the rest) exactly as the server does; the registry must then render (`to_json`, the `query`
//! snapshot). Nothing may panic whatever the numbers (devices, sizes, counters) say.
#![no_main]
use libfuzzer_sys::fuzz_target;
use vramcap_fuzz::sidecar::state::{Client, Registry};

fuzz_target!(|data: &[u8]| {
    let mut client: Option<Client> = None;
    for raw in data.split(|&b| b == b'\n') {
        let Ok(v @ serde_json::Value::Object(_)) = serde_json::from_slice::<serde_json::Value>(raw.trim_ascii()) else {
            continue;
        };
        match &mut client {
            None => client = Client::from_header(4242, 1000, &v).ok(),
            Some(c) => {
                if c.apply(&v).is_err() {
                    break; // the server drops the connection here
                }
            }
        }
    }
    if let Some(c) = client {
        let _ = c.to_json();
        let mut reg = Registry::default();
        reg.clients.insert(1, c);
        let _ = reg.snapshot();
    }
});
