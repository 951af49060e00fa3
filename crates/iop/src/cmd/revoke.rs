//! `iop revoke NODE`: revokes every credential a node holds on a running edge. Its live
//! connection is closed at once (the node exits, saying it was revoked), its certificate
//! and static token no longer register, its join tokens are deleted; this survives edge
//! restarts. A new join token (or a new certificate or token) lets it back in.

use super::edge_api::EdgeApi;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The node id to revoke.
    node: String,
    #[command(flatten)]
    api: EdgeApi,
}

pub async fn run(args: Args) -> super::Result {
    let client = args.api.client()?;
    let body = args
        .api
        .send(client.post(args.api.url(&format!("/admin/nodes/{}/revoke", args.node))))
        .await?;
    println!(
        "node {} revoked: live connection {}, {} join token(s) deleted",
        args.node,
        if body["session_closed"] == true {
            "closed"
        } else {
            "none"
        },
        body["join_tokens_removed"]
    );
    Ok(())
}
