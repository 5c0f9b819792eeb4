//! Which WAL position the relay may confirm to PostgreSQL: never past a transaction with an outbox
//! row whose event does not yet have its PubAck (and its mark), nor into a transaction whose Commit
//! has not been read, and, while nothing is waiting, up to where the server says the WAL ends — so
//! that a slot on an idle outbox keeps advancing and retains no WAL.

use std::collections::VecDeque;

/// A transaction the relay read (from its Begin; it committed before the server sent it), by its
/// place in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

/// A transaction read and not all done.
#[derive(Debug)]
struct Waiting {
    /// The end of its commit: `None` until its Commit is read.
    end: Option<u64>,
    /// Its rows handed out to be published and not yet done.
    left: usize,
}

/// The confirmable position, kept as transactions are read and their rows are done.
///
/// A transaction gets its ticket at its Begin, so that its rows can be handed out in parts before
/// its Commit is read: the server sends a transaction only once it has committed, and a large one's
/// rows are published while the rest of it is still arriving, rather than held until its end.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Transactions read and not all done, oldest first; the last one may still be open.
    waiting: VecDeque<Waiting>,
    /// The ticket of `waiting`'s front.
    first: u64,
    /// The furthest position known to hold nothing undone.
    safe: u64,
}

impl Ledger {
    /// Starts from the position the slot confirmed last.
    pub fn starting_at(confirmed: u64) -> Self {
        Self {
            safe: confirmed,
            ..Self::default()
        }
    }

    /// A Begin was read: the transaction's ticket, under which its rows are handed out.
    pub fn begin(&mut self) -> Ticket {
        let ticket = Ticket(self.first + self.waiting.len() as u64);
        self.waiting.push_back(Waiting { end: None, left: 0 });
        ticket
    }

    /// `rows` more rows of the transaction `ticket` are handed out to be published.
    pub fn hand_out(&mut self, ticket: Ticket, rows: usize) {
        if let Some(waiting) = self.get_mut(ticket) {
            waiting.left += rows;
        }
    }

    /// The Commit of the transaction `ticket`, ending at `end`, was read: once its rows are done,
    /// the position may pass it.
    pub fn commit(&mut self, ticket: Ticket, end: u64) {
        if let Some(waiting) = self.get_mut(ticket) {
            waiting.end = Some(end);
        }
        self.advance();
    }

    /// `rows` rows of the transaction `ticket` are done (PubAcked and recorded).
    pub fn done(&mut self, ticket: Ticket, rows: usize) {
        if let Some(waiting) = self.get_mut(ticket) {
            waiting.left = waiting.left.saturating_sub(rows);
        }
        self.advance();
    }

    /// A keepalive said the server's WAL ends at `wal_end`: everything before it was sent on this
    /// stream already. Confirmable only when nothing is waiting and no transaction is open.
    pub fn keepalive(&mut self, wal_end: u64) {
        if self.waiting.is_empty() {
            self.safe = self.safe.max(wal_end);
        }
    }

    /// The position to confirm: every outbox row committed at or before it is done.
    pub fn confirmable(&self) -> u64 {
        self.safe
    }

    /// Rows handed out and not yet done.
    pub fn rows_waiting(&self) -> usize {
        self.waiting.iter().map(|waiting| waiting.left).sum()
    }

    fn get_mut(&mut self, ticket: Ticket) -> Option<&mut Waiting> {
        let index = usize::try_from(ticket.0.checked_sub(self.first)?).ok()?;
        self.waiting.get_mut(index)
    }

    fn advance(&mut self) {
        while let Some(&Waiting {
            end: Some(end),
            left: 0,
        }) = self.waiting.front()
        {
            self.safe = self.safe.max(end);
            self.waiting.pop_front();
            self.first += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole transaction read at once: Begin, its rows, Commit.
    fn read(ledger: &mut Ledger, end: u64, rows: usize) -> Ticket {
        let ticket = ledger.begin();
        ledger.hand_out(ticket, rows);
        ledger.commit(ticket, end);
        ticket
    }

    #[test]
    fn a_transaction_is_confirmed_only_when_all_of_its_rows_are_done() {
        let mut ledger = Ledger::starting_at(100);
        let t = read(&mut ledger, 200, 3);
        assert_eq!(ledger.confirmable(), 100);
        ledger.done(t, 2);
        assert_eq!(ledger.confirmable(), 100);
        ledger.done(t, 1);
        assert_eq!(ledger.confirmable(), 200);
    }

    #[test]
    fn a_transaction_done_in_parts_before_its_commit_is_read_waits_for_the_commit() {
        let mut ledger = Ledger::starting_at(10);
        let t = ledger.begin();
        ledger.hand_out(t, 2);
        ledger.done(t, 2);
        assert_eq!(ledger.confirmable(), 10, "its commit is not read yet");
        ledger.keepalive(500);
        assert_eq!(
            ledger.confirmable(),
            10,
            "a keepalive cannot pass it either"
        );
        ledger.hand_out(t, 1);
        ledger.commit(t, 90);
        assert_eq!(ledger.confirmable(), 10, "its last part is not done");
        ledger.done(t, 1);
        assert_eq!(ledger.confirmable(), 90);
        assert_eq!(ledger.rows_waiting(), 0);
    }

    #[test]
    fn a_later_transaction_done_first_waits_for_the_earlier_one() {
        let mut ledger = Ledger::starting_at(0);
        let first = read(&mut ledger, 10, 1);
        let second = read(&mut ledger, 20, 1);
        ledger.done(second, 1);
        assert_eq!(ledger.confirmable(), 0, "the first is not done");
        ledger.done(first, 1);
        assert_eq!(ledger.confirmable(), 20);
        assert_eq!(ledger.rows_waiting(), 0);
    }

    #[test]
    fn keepalives_advance_an_idle_slot_but_never_past_waiting_rows() {
        let mut ledger = Ledger::starting_at(5);
        ledger.keepalive(50);
        assert_eq!(ledger.confirmable(), 50, "idle: up to the end of the WAL");
        let t = read(&mut ledger, 60, 1);
        ledger.keepalive(90);
        assert_eq!(ledger.confirmable(), 50, "a row is waiting");
        ledger.done(t, 1);
        assert_eq!(ledger.confirmable(), 60);
        let open = ledger.begin();
        ledger.keepalive(120);
        assert_eq!(ledger.confirmable(), 60, "inside a transaction");
        ledger.commit(open, 130);
        ledger.keepalive(140);
        assert_eq!(ledger.confirmable(), 140);
    }

    #[test]
    fn the_position_never_goes_back() {
        let mut ledger = Ledger::starting_at(100);
        ledger.keepalive(40);
        let t = read(&mut ledger, 80, 1);
        ledger.done(t, 1);
        ledger.done(t, 5);
        ledger.done(Ticket(99), 1);
        assert_eq!(ledger.confirmable(), 100);
    }
}
