//! `iop status`: prints an edge's `/admin/status` as a table (or raw JSON).

use serde_json::Value;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The edge's HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// An admin API key, if the edge has keys (`/admin/status` is admin-only).
    #[arg(long, env = "IOP_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Print the JSON snapshot as it is.
    #[arg(long)]
    json: bool,
}

pub async fn run(args: Args) -> super::Result {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = format!("{}/admin/status", args.url.trim_end_matches('/'));
    let mut request = reqwest::Client::new().get(&url);
    if let Some(key) = &args.api_key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {e}"))?;
    let status = response.status();
    let body: Value = response
        .json()
        .await
        .map_err(|e| format!("{url}: not a status snapshot: {e}"))?;
    if !status.is_success() {
        return Err(format!("{url}: {status}: {body}").into());
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(());
    }
    println!(
        "{:<16} {:<12} {:<16} {:<14} {:<12} {:>10} {:>10}",
        "NODE", "STATE", "PROVIDER", "KIND", "STATUS", "CAP n/l", "BUSY n/l"
    );
    let lanes = |v: &Value| format!("{}/{}", v["normal"], v["long"]);
    for node in body["nodes"].as_array().into_iter().flatten() {
        let providers = node["providers"].as_array().cloned().unwrap_or_default();
        if providers.is_empty() {
            println!(
                "{:<16} {:<12}",
                node["id"].as_str().unwrap_or(""),
                node["state"].as_str().unwrap_or("")
            );
        }
        for p in providers {
            println!(
                "{:<16} {:<12} {:<16} {:<14} {:<12} {:>10} {:>10}",
                node["id"].as_str().unwrap_or(""),
                node["state"].as_str().unwrap_or(""),
                p["id"].as_str().unwrap_or(""),
                p["kind"].as_str().unwrap_or(""),
                p["status"].as_str().unwrap_or(""),
                lanes(&p["capacity"]),
                lanes(&p["in_flight"]),
            );
        }
    }
    let groups = body["model_groups"].as_array().cloned().unwrap_or_default();
    if !groups.is_empty() {
        println!();
        println!("{:<24} {:>12} MEMBERS", "MODEL", "WAITING n/l");
        for g in groups {
            let members: Vec<String> = g["members"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|m| {
                    format!(
                        "{}/{}",
                        m["node"].as_str().unwrap_or(""),
                        m["provider"].as_str().unwrap_or("")
                    )
                })
                .collect();
            println!(
                "{:<24} {:>12} {}",
                g["name"].as_str().unwrap_or(""),
                lanes(&g["waiting"]),
                members.join(", ")
            );
        }
    }
    Ok(())
}
