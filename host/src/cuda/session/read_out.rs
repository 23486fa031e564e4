//! Where a session's sequence stands and what reading it gives ([`ReadOut`]): its length,
//! which logits buffer the guest reads, whether the argmax of those logits is known on the
//! host or still to be read from the GPU, the all-position logits of the last extend, and
//! the decode step run ahead on the session's own stream.
//!
//! Every step changes several of these together; each kind of step is one transition here,
//! setting every field it must, so that no caller sets them by hand. Plain host-side state:
//! the session launches the work, this records what it left behind.

/// A decode step run ahead on a session's own stream (see [`super::ahead`]): the position
/// and the token it was fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct OwnAhead {
    position: usize,
    token: u32,
    /// The logits buffer it writes (see [`super::CudaSession::logits_at`]).
    buffer: usize,
}

/// A session's read-out state; see the module docs.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ReadOut {
    /// Positions in the KV cache.
    len: usize,
    /// Which logits buffer holds the last logits, the one the guest reads: 0 the session's
    /// first, the others the ones steps run ahead write (see [`super::LOGITS_BUFFERS`]).
    readable: usize,
    /// The argmax of the last logits when it is known on the host (a batched step brought
    /// it back, or a decode run ahead read it); None: its key is read from the GPU when
    /// asked.
    argmax: Option<u32>,
    /// Rows of all-position logits from the last extend (0 when not asked for).
    all_rows: usize,
    /// Where the current prefill's all-position logits go (rows already written by the
    /// earlier chunks of the same extend).
    all_offset: usize,
    /// The position `ids[0]` holds after the last decode through this session's own graph
    /// (None after prompts and batched steps, which leave something else there): a decode
    /// run ahead takes the position after it.
    own_decode_at: Option<usize>,
    /// The decode step run ahead on this session's stream, if any.
    own_ahead: Option<OwnAhead>,
    /// Work run ahead may still be under way on this session's stream: a batched pass waits
    /// for it before it touches the session's cache.
    own_in_flight: bool,
}

impl ReadOut {
    /// Positions in the KV cache.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The logits buffer the guest reads.
    pub(super) fn readable(&self) -> usize {
        self.readable
    }

    /// The argmax of the last logits, when known on the host.
    pub(super) fn argmax(&self) -> Option<u32> {
        self.argmax
    }

    /// Rows of all-position logits from the last extend.
    pub(super) fn all_rows(&self) -> usize {
        self.all_rows
    }

    /// Rows of all-position logits the earlier chunks of this extend wrote.
    pub(super) fn all_offset(&self) -> usize {
        self.all_offset
    }

    /// Whether the last step was a decode through this session's own graph, so `ids[0]`
    /// holds its position and a decode may run ahead from it.
    pub(super) fn follows_own_decode(&self) -> bool {
        self.len
            .checked_sub(1)
            .is_some_and(|p| self.own_decode_at == Some(p))
    }

    /// The logits buffer a decode run ahead on the session's stream writes: one the guest is
    /// not reading (the first or the second).
    pub(super) fn own_ahead_buffer(&self) -> usize {
        usize::from(self.readable == 0)
    }

    /// Whether work run ahead may still be under way on the session's stream.
    pub(super) fn own_in_flight(&self) -> bool {
        self.own_in_flight
    }

    /// Nothing run ahead on the session's own stream.
    pub(super) fn idle_own(&self) -> bool {
        self.own_ahead.is_none() && !self.own_in_flight
    }

    /// A chunk of an extend starts on the session's stream: the outputs of the last step are
    /// gone; with `continued` (a later chunk of one extend) its all-position logits follow
    /// the earlier chunks'.
    pub(super) fn chunk_started(&mut self, all_positions: bool, continued: bool) {
        self.argmax = None;
        self.readable = 0;
        self.all_offset = if all_positions && continued {
            self.all_rows
        } else {
            0
        };
    }

    /// The chunk's `added` positions are launched (all-position logits written when asked).
    pub(super) fn chunk_done(&mut self, added: usize, all_positions: bool) {
        self.all_rows = if all_positions {
            self.all_offset + added
        } else {
            0
        };
        self.len += added;
    }

    /// A decode or a prefill of its own is about to be launched on the session's stream: the
    /// step run ahead is forgotten, and `ids[0]` is about to change.
    pub(super) fn own_step_begins(&mut self) {
        self.own_ahead = None;
        self.own_decode_at = None;
    }

    /// `ids[0]` holds the current position for the decode graph.
    pub(super) fn decode_position_uploaded(&mut self) {
        self.own_decode_at = Some(self.len);
    }

    /// A batched pass appended `added` positions and left the last one's logits in the first
    /// buffer, with their argmax when the step brought it back (None: it comes with
    /// [`Self::argmax_arrived`], or is read from the GPU).
    pub(super) fn after_batched_step(&mut self, added: usize, argmax: Option<u32>) {
        self.own_decode_at = None;
        self.len += added;
        self.all_rows = 0;
        self.readable = 0;
        self.argmax = argmax;
    }

    /// The argmax of the last logits is now known on the host.
    pub(super) fn argmax_arrived(&mut self, argmax: u32) {
        self.argmax = Some(argmax);
    }

    /// A step run ahead in a batched pass is this session's next step: one position, its
    /// logits in `buffer`, its argmax when known (None: the pass is still under way).
    pub(super) fn took_batched_ahead(&mut self, buffer: usize, argmax: Option<u32>) {
        self.own_decode_at = None;
        self.len += 1;
        self.all_rows = 0;
        self.readable = buffer;
        self.argmax = argmax;
    }

    /// A decode run ahead was launched on the session's stream.
    pub(super) fn own_ahead_launched(&mut self) {
        self.own_in_flight = true;
    }

    /// The argmax of the step just run came back (before the step run ahead cleared it): it
    /// is known on the host, and it is the token the step run ahead (writing `buffer`) was
    /// fed, at the current position. A key past the vocabulary (the kernel feeds row 0 then)
    /// is no guess.
    pub(super) fn own_ahead_fed(&mut self, argmax: u32, buffer: usize, vocab: usize) {
        if (argmax as usize) < vocab {
            self.own_ahead = Some(OwnAhead {
                position: self.len,
                token: argmax,
                buffer,
            });
        }
        self.argmax = Some(argmax);
    }

    /// Take the decode run ahead on the session's stream as the next step when it is
    /// `token` at the current position: one position more, its logits buffer the one read,
    /// its argmax on the GPU, and `ids[0]` holding its position. False otherwise; the step run
    /// ahead is forgotten either way.
    pub(super) fn take_own_ahead(&mut self, token: u32) -> bool {
        let Some(ahead) = self
            .own_ahead
            .take()
            .filter(|a| a.position == self.len && a.token == token)
        else {
            return false;
        };
        self.own_decode_at = Some(self.len);
        self.len += 1;
        self.all_rows = 0;
        self.readable = ahead.buffer;
        self.argmax = None;
        true
    }

    /// Forget the decode run ahead on the session's stream (a batched pass takes over).
    pub(super) fn forget_own_ahead(&mut self) {
        self.own_ahead = None;
    }

    /// The session's stream was waited for: nothing run ahead is under way on it.
    pub(super) fn own_settled(&mut self) {
        self.own_in_flight = false;
    }

    /// Keep at most `len` positions; a step run ahead was for the old sequence when it gets
    /// shorter (the same length keeps it).
    pub(super) fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.own_ahead = None;
        }
        self.len = self.len.min(len);
    }

    /// Forget the sequence (length 0) and its outputs.
    pub(super) fn reset(&mut self) {
        *self = Self::default();
    }
}

/// Transitions for the benchmarks' hooks (the `dev` feature).
#[cfg(feature = "dev")]
impl ReadOut {
    /// A decode whose logits are not read back starts: the outputs of the last step are
    /// gone (the all-position logits stay).
    pub(super) fn bare_decode_started(&mut self) {
        self.argmax = None;
        self.readable = 0;
    }

    /// The bare decode's position is launched.
    pub(super) fn bare_decode_done(&mut self) {
        self.len += 1;
    }

    /// The length alone, nothing else (the benchmark timing a captured prefill from 0).
    pub(super) fn set_len_only(&mut self, len: usize) {
        self.len = len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A session after a prompt of `len` tokens and a decode through its own graph at
    /// `len`, the decode's argmax read back and run ahead into the spare buffer.
    fn ran_ahead(len: usize, token: u32) -> ReadOut {
        let mut r = ReadOut::default();
        r.chunk_started(false, false);
        r.own_step_begins();
        r.chunk_done(len, false);
        r.chunk_started(false, false);
        r.own_step_begins();
        r.decode_position_uploaded();
        r.chunk_done(1, false);
        assert!(r.follows_own_decode());
        let buffer = r.own_ahead_buffer();
        r.own_ahead_launched();
        r.own_ahead_fed(token, buffer, 50257);
        r
    }

    #[test]
    fn new_is_empty() {
        let r = ReadOut::default();
        assert_eq!(
            (r.len(), r.readable(), r.argmax(), r.all_rows()),
            (0, 0, None, 0)
        );
        assert!(r.idle_own());
        assert!(!r.follows_own_decode());
    }

    #[test]
    fn chunks_of_one_extend_append_their_all_position_rows() {
        let mut r = ReadOut::default();
        r.argmax_arrived(7);
        r.chunk_started(true, false);
        assert_eq!((r.argmax(), r.readable(), r.all_offset()), (None, 0, 0));
        r.chunk_done(5, true);
        assert_eq!((r.len(), r.all_rows()), (5, 5));
        r.chunk_started(true, true);
        assert_eq!(r.all_offset(), 5);
        r.chunk_done(3, true);
        assert_eq!((r.len(), r.all_rows()), (8, 8));
        // a new extend starts its rows again; one without all positions has none
        r.chunk_started(true, false);
        assert_eq!(r.all_offset(), 0);
        r.chunk_done(2, true);
        assert_eq!(r.all_rows(), 2);
        r.chunk_started(false, true);
        assert_eq!(r.all_offset(), 0);
        r.chunk_done(1, false);
        assert_eq!((r.len(), r.all_rows()), (11, 0));
    }

    #[test]
    fn a_failed_chunk_keeps_length_and_rows() {
        let mut r = ReadOut::default();
        r.chunk_started(true, false);
        r.chunk_done(4, true);
        r.chunk_started(true, true);
        // the launch failed: no chunk_done
        assert_eq!((r.len(), r.all_rows(), r.all_offset()), (4, 4, 4));
    }

    #[test]
    fn only_an_uploaded_decode_position_lets_a_decode_run_ahead() {
        let mut r = ReadOut::default();
        r.chunk_started(false, false);
        r.own_step_begins();
        r.chunk_done(3, false);
        assert!(
            !r.follows_own_decode(),
            "a prefill leaves no decode position"
        );
        r.chunk_started(false, false);
        r.own_step_begins();
        // the upload failed: no decode_position_uploaded, no chunk_done
        assert!(!r.follows_own_decode());
        r.own_step_begins();
        r.decode_position_uploaded();
        r.chunk_done(1, false);
        assert!(r.follows_own_decode());
        r.after_batched_step(1, Some(9));
        assert!(
            !r.follows_own_decode(),
            "a batched pass leaves another position"
        );
    }

    #[test]
    fn a_batched_step_reads_the_first_buffer() {
        let mut r = ran_ahead(4, 11);
        assert_eq!(r.readable(), 0);
        assert!(r.take_own_ahead(11));
        assert_eq!(r.readable(), 1);
        r.after_batched_step(2, Some(42));
        // (the stream's work run ahead is still counted until the session waits for it)
        let expected = ReadOut {
            len: 8,
            argmax: Some(42),
            own_in_flight: true,
            ..ReadOut::default()
        };
        assert_eq!(r, expected);
        r.after_batched_step(1, None);
        assert_eq!((r.len(), r.argmax()), (9, None));
        r.argmax_arrived(3);
        assert_eq!(r.argmax(), Some(3));
    }

    #[test]
    fn a_batched_step_clears_all_position_rows() {
        let mut r = ReadOut::default();
        r.chunk_started(true, false);
        r.chunk_done(6, true);
        r.after_batched_step(1, None);
        assert_eq!(r.all_rows(), 0);
        r.chunk_started(true, false);
        r.chunk_done(6, true);
        r.took_batched_ahead(2, None);
        assert_eq!(r.all_rows(), 0);
    }

    #[test]
    fn taking_a_batched_step_run_ahead_reads_its_buffer() {
        let mut r = ran_ahead(4, 11);
        r.took_batched_ahead(2, None);
        assert_eq!((r.len(), r.readable(), r.argmax()), (6, 2, None));
        assert!(!r.follows_own_decode());
        r.took_batched_ahead(1, Some(5));
        assert_eq!((r.len(), r.readable(), r.argmax()), (7, 1, Some(5)));
    }

    #[test]
    fn a_decode_run_ahead_writes_a_buffer_not_read() {
        let mut r = ReadOut::default();
        assert_eq!(r.own_ahead_buffer(), 1);
        r.took_batched_ahead(1, None);
        assert_eq!(r.own_ahead_buffer(), 0);
        r.took_batched_ahead(2, None);
        assert_eq!(r.own_ahead_buffer(), 0);
    }

    #[test]
    fn the_decode_run_ahead_is_taken_for_its_token_at_its_position() {
        let mut r = ran_ahead(4, 11);
        assert_eq!((r.len(), r.argmax()), (5, Some(11)));
        assert!(!r.idle_own());
        assert!(r.take_own_ahead(11));
        assert_eq!((r.len(), r.readable(), r.argmax()), (6, 1, None));
        assert!(
            r.follows_own_decode(),
            "ids[0] holds the taken step's position"
        );
        // taken once
        assert!(!r.take_own_ahead(11));

        let mut other = ran_ahead(4, 11);
        assert!(!other.take_own_ahead(12));
        assert_eq!((other.len(), other.readable()), (5, 0));
        assert!(
            !other.take_own_ahead(11),
            "a miss forgets the step run ahead"
        );
    }

    #[test]
    fn a_key_past_the_vocabulary_is_no_guess() {
        let mut r = ReadOut::default();
        r.own_ahead_launched();
        r.own_ahead_fed(50257, 1, 50257);
        assert_eq!(r.argmax(), Some(50257));
        assert!(!r.take_own_ahead(50257));
        r.own_ahead_fed(50256, 1, 50257);
        assert!(r.take_own_ahead(50256));
    }

    #[test]
    fn settling_forgets_the_step_run_ahead_and_the_stream_work() {
        let mut r = ran_ahead(4, 11);
        r.forget_own_ahead();
        assert!(!r.idle_own() && r.own_in_flight());
        r.own_settled();
        assert!(r.idle_own());
        assert!(!r.take_own_ahead(11));
    }

    #[test]
    fn truncating_shorter_forgets_the_step_run_ahead() {
        let mut r = ran_ahead(4, 11);
        r.truncate(5);
        r.truncate(9);
        assert_eq!(r.len(), 5);
        assert!(r.take_own_ahead(11), "the same length keeps it");

        let mut r = ran_ahead(4, 11);
        r.truncate(4);
        assert_eq!(r.len(), 4);
        assert!(!r.take_own_ahead(11));
        assert!(r.own_in_flight(), "the stream's work is still under way");
    }

    #[test]
    fn reset_forgets_everything() {
        let mut r = ran_ahead(4, 11);
        r.chunk_started(true, true);
        r.reset();
        assert_eq!(r, ReadOut::default());
    }

    #[cfg(feature = "dev")]
    #[test]
    fn a_bare_decode_keeps_the_all_position_rows() {
        let mut r = ReadOut::default();
        r.chunk_started(true, false);
        r.chunk_done(3, true);
        r.argmax_arrived(1);
        r.bare_decode_started();
        r.bare_decode_done();
        assert_eq!((r.len(), r.argmax(), r.all_rows()), (4, None, 3));
        r.set_len_only(0);
        assert_eq!((r.len(), r.all_rows()), (0, 3));
    }
}
