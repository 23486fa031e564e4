//! How a pre-initialised snapshot is told from a plain guest: [`super::preinitialize`] ends
//! every snapshot, module or component, with a custom section of its own. A component keeps
//! its init export (see [`super::preinitialize_component`]), so the export alone does not
//! say.

/// The custom section every snapshot ends with.
pub const SNAPSHOT_SECTION: &str = "wasi-nn-host:preinitialised";

/// `snapshot` with [`SNAPSHOT_SECTION`] appended (a custom section is valid at the end of a
/// module and of a component alike).
pub(super) fn marked(mut snapshot: Vec<u8>) -> Vec<u8> {
    snapshot.extend_from_slice(&snapshot_section());
    snapshot
}

fn snapshot_section() -> Vec<u8> {
    use wasm_encoder::Section;
    let section = wasm_encoder::CustomSection {
        name: SNAPSHOT_SECTION.into(),
        data: (&[][..]).into(),
    };
    let mut bytes = Vec::new();
    section.append_to(&mut bytes);
    bytes
}

/// Whether `wasm` is a snapshot [`super::preinitialize`] wrote: it ends with [`SNAPSHOT_SECTION`].
/// A tool that strips custom sections, or appends one, makes a snapshot read as plain, and
/// [`super::Host::load_component_preinitialised`] then runs its init export again (which
/// `gpt2_component.wasm`'s returns from at once).
pub fn is_preinitialised(wasm: &[u8]) -> bool {
    wasm.ends_with(&snapshot_section())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_guest_reads_as_a_snapshot_and_an_unmarked_one_does_not() {
        let plain = b"\0asm\x01\0\0\0".to_vec();
        assert!(!is_preinitialised(&plain));
        let snapshot = marked(plain.clone());
        assert!(is_preinitialised(&snapshot));
        // something appended after the marker hides it
        let mut changed = snapshot;
        changed.push(0);
        assert!(!is_preinitialised(&changed));
    }
}
