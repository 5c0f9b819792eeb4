//! Which WAL position the relay may confirm to PostgreSQL: never past a transaction with an outbox
//! row whose event does not yet have its PubAck (and its mark), and, while nothing is waiting, up to
//! where the server says the WAL ends — so that a slot on an idle outbox keeps advancing and retains
//! no WAL.

use std::collections::VecDeque;

/// A committed transaction the relay read, by its place in the ledger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

/// The confirmable position, kept as transactions are read and their rows are done.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Between a Begin and its Commit: nothing past the last commit may be confirmed.
    inside: bool,
    /// Transactions read and not all done, oldest first: (end of commit, rows still waiting).
    waiting: VecDeque<(u64, usize)>,
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

    /// A Begin was read.
    pub fn begin(&mut self) {
        self.inside = true;
    }

    /// A Commit ending at `end` was read; `rows` of its outbox rows are to be published.
    pub fn commit(&mut self, end: u64, rows: usize) -> Ticket {
        self.inside = false;
        let ticket = Ticket(self.first + self.waiting.len() as u64);
        self.waiting.push_back((end, rows));
        self.advance();
        ticket
    }

    /// `rows` rows of the transaction `ticket` are done (PubAcked and recorded).
    pub fn done(&mut self, ticket: Ticket, rows: usize) {
        let Some(index) = ticket.0.checked_sub(self.first) else {
            return;
        };
        if let Some((_, left)) = usize::try_from(index)
            .ok()
            .and_then(|i| self.waiting.get_mut(i))
        {
            *left = left.saturating_sub(rows);
        }
        self.advance();
    }

    /// A keepalive said the server's WAL ends at `wal_end`: everything before it was sent on this
    /// stream already. Confirmable only when nothing is waiting and no transaction is open.
    pub fn keepalive(&mut self, wal_end: u64) {
        if !self.inside && self.waiting.is_empty() {
            self.safe = self.safe.max(wal_end);
        }
    }

    /// The position to confirm: every outbox row committed at or before it is done.
    pub fn confirmable(&self) -> u64 {
        self.safe
    }

    /// Rows read and not yet done.
    pub fn rows_waiting(&self) -> usize {
        self.waiting.iter().map(|(_, left)| left).sum()
    }

    fn advance(&mut self) {
        while let Some(&(end, 0)) = self.waiting.front() {
            self.safe = self.safe.max(end);
            self.waiting.pop_front();
            self.first += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transaction_is_confirmed_only_when_all_of_its_rows_are_done() {
        let mut ledger = Ledger::starting_at(100);
        ledger.begin();
        let t = ledger.commit(200, 3);
        assert_eq!(ledger.confirmable(), 100);
        ledger.done(t, 2);
        assert_eq!(ledger.confirmable(), 100);
        ledger.done(t, 1);
        assert_eq!(ledger.confirmable(), 200);
    }

    #[test]
    fn a_later_transaction_done_first_waits_for_the_earlier_one() {
        let mut ledger = Ledger::starting_at(0);
        let first = ledger.commit(10, 1);
        let second = ledger.commit(20, 1);
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
        let t = ledger.commit(60, 1);
        ledger.keepalive(90);
        assert_eq!(ledger.confirmable(), 50, "a row is waiting");
        ledger.done(t, 1);
        assert_eq!(ledger.confirmable(), 60);
        ledger.begin();
        ledger.keepalive(120);
        assert_eq!(ledger.confirmable(), 60, "inside a transaction");
        ledger.commit(130, 0);
        ledger.keepalive(140);
        assert_eq!(ledger.confirmable(), 140);
    }

    #[test]
    fn the_position_never_goes_back() {
        let mut ledger = Ledger::starting_at(100);
        ledger.keepalive(40);
        let t = ledger.commit(80, 1);
        ledger.done(t, 1);
        ledger.done(t, 5);
        ledger.done(Ticket(99), 1);
        assert_eq!(ledger.confirmable(), 100);
    }
}
