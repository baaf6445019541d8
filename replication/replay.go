package replication

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
)

// tipReplay checks that a slot starting at or before the stream's tip
// replays the history the stream holds. The rewind check at session open
// (verify) compares the tip with the server's WAL position, and that races
// with writers: a server restored in place and written past the tip before
// jetbox reconnects passes it, and its new transactions at or before the
// tip would then be taken for replays (skipped, or deduplicated) and
// confirmed. So while the replay is unproven the session confirms nothing
// past where the slot started, and the replay must reproduce the tip
// itself: the same Nats-Msg-Id at the same position. Reaching past the tip
// without it (an event, a commit or the walsender's position after it)
// means the WAL there is another history: a *HistoryError (CaseRewind).
//
// A replay that passes the tip before any event at or before it went by
// skipped nothing as a replay, so it loses nothing and goes on: that is
// also a slot whose confirmed position moved past the tip after this
// session read both (another instance streamed until this one took over).
type tipReplay struct {
	tip      StreamTip
	pending  bool // the tip has not been reproduced yet
	replayed bool // an event at or before the tip went by (the sink skips it as a replay)
}

// newTipReplay arms the check when the slot's confirmed position start is
// at or before the tip's commit (the tip's transaction is replayed). tip
// must be this database's and slot's (ownTip).
func newTipReplay(tip StreamTip, start pglogrepl.LSN) *tipReplay {
	return &tipReplay{tip: tip, pending: tip.ID != "" && start <= tip.CommitLSN}
}

// holding reports whether confirmations must stay where the slot started.
func (r *tipReplay) holding() bool { return r != nil && r.pending }

// event checks an event of the replay at (lsn, index) with id.
func (r *tipReplay) event(lsn pglogrepl.LSN, index int, id string) error {
	if !r.holding() {
		return nil
	}
	switch {
	case lsn < r.tip.CommitLSN || (lsn == r.tip.CommitLSN && index < r.tip.TxIndex):
		r.replayed = true // before the tip: the replay goes on
		return nil
	case lsn == r.tip.CommitLSN && index == r.tip.TxIndex && (id == r.tip.ID || (r.tip.RowID != "" && id == r.tip.RowID)):
		// The same message, or the dead letter the sink stored for the row
		// (a repeated id, too large for the server): it carries the row's id.
		r.pending = false
		return nil
	case lsn == r.tip.CommitLSN && index == r.tip.TxIndex:
		return r.mismatch(fmt.Sprintf("the slot replays row id %q at the stream's last position (transaction %s, row %d), where the stream holds id %q", id, lsn, index, r.tip.ID))
	case !r.replayed:
		r.pending = false // past the tip, nothing skipped
		return nil
	}
	return r.mismatch(fmt.Sprintf("the slot's replay reached row id %q at transaction %s, row %d, past the stream's last position (transaction %s, row %d, id %q) without reproducing it", id, lsn, index, r.tip.CommitLSN, r.tip.TxIndex, r.tip.ID))
}

// invalid checks a replayed row that cannot be published now but that the
// stream holds (see loop.decodeFailed): at the tip's position the stream
// may hold its dead letter, whose id is derived from the position; it
// names the row it stands for (Jetbox-Row-Id), which must be this one.
func (r *tipReplay) invalid(lsn pglogrepl.LSN, index int, rowID string) error {
	if r.holding() && lsn == r.tip.CommitLSN && index == r.tip.TxIndex && r.tip.ID == decoder.DeadLetterID(lsn, index) &&
		(rowID == "" || r.tip.RowID == "" || r.tip.RowID == decoder.RowIDHeader(rowID)) {
		r.pending = false
		return nil
	}
	return r.event(lsn, index, rowID)
}

// commit checks the end of a replayed transaction that committed at lsn.
func (r *tipReplay) commit(lsn pglogrepl.LSN) error {
	if !r.holding() || lsn < r.tip.CommitLSN {
		return nil
	}
	if !r.replayed {
		r.pending = false
		return nil
	}
	return r.mismatch(fmt.Sprintf("the slot's replay committed transaction %s without the stream's last row (transaction %s, row %d, id %q)", lsn, r.tip.CommitLSN, r.tip.TxIndex, r.tip.ID))
}

// walEnd checks the walsender's position, between transactions: past the
// tip's commit record, the tip's transaction was decoded and did not hold
// the tip.
func (r *tipReplay) walEnd(lsn pglogrepl.LSN) error {
	if !r.holding() || lsn <= r.tip.CommitLSN {
		return nil
	}
	if !r.replayed {
		r.pending = false
		return nil
	}
	return r.mismatch(fmt.Sprintf("the walsender decoded up to %s, past the stream's last position (transaction %s, row %d, id %q), without replaying it", lsn, r.tip.CommitLSN, r.tip.TxIndex, r.tip.ID))
}

func (r *tipReplay) mismatch(what string) error {
	return &HistoryError{Case: CaseRewind, Tip: r.tip, Detail: "the slot's replay does not reproduce the stream's last message: " + what +
		"; the server's WAL is not the history the stream holds (the server was restored from a snapshot or backup, or rewound, and written since); nothing past the slot's position was confirmed"}
}

// peekReplay runs r over what the slot would stream up to the tip's
// transaction, without consuming it (pg_logical_slot_peek_binary_changes):
// jetbox repair and the start-up checks see a server restored in place and
// written past the tip before a session streams anything. A slot another
// process streams from cannot be peeked: the session's own check (the
// loop's tipReplay) covers it.
func peekReplay(ctx context.Context, connString string, cfg Config, r *tipReplay) error {
	if !r.holding() {
		return nil
	}
	pcfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return fmt.Errorf("parse postgres URL: %w", err)
	}
	pcfg.RuntimeParams["application_name"] = "jetbox history check"
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("%w: connect to postgres: %w", ErrUnreachable, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// Read before the peek: its rows hold the connection until closed.
	dec := decoder.New(cfg.Decoder)
	if domains, err := readDomains(ctx, conn.PgConn()); err == nil {
		dec.SetDomains(domains)
	}
	if parts, err := readPartitions(ctx, conn.PgConn(), cfg); err == nil && cfg.hasTable() {
		defer setPartitions(dec, parts, connString)()
	}
	args := []any{cfg.Slot, (r.tip.CommitLSN + 1).String(), quoteIdent(cfg.Publication)}
	q := "SELECT data FROM pg_logical_slot_peek_binary_changes($1, $2::pg_lsn, NULL, 'proto_version', '1', 'publication_names', $3"
	if cfg.Decoder.MessagePrefix != "" {
		q += ", 'messages', 'true'"
	}
	rows, err := conn.Query(ctx, q+")", args...)
	if isSlotInUse(err) {
		return nil // another process streams it: its session checks the replay
	}
	if err != nil {
		return fmt.Errorf("read what slot %q replays up to the stream's last position %s: %w", cfg.Slot, r.tip.CommitLSN, err)
	}
	defer rows.Close()
	for rows.Next() && r.holding() {
		msg, err := dec.Decode(rows.RawValues()[0])
		var ie *decoder.InvalidEventError
		switch {
		case errors.As(err, &ie):
			return nil // a row --on-invalid=stop stops on: the streaming session judges
		case err != nil:
			return nil // a change the streaming session stops on, with its own error
		case msg.Kind == decoder.KindEvent:
			err = r.event(msg.Event.CommitLSN, msg.Event.TxIndex, msg.Event.ID)
		case msg.Kind == decoder.KindCommit:
			err = r.commit(msg.CommitLSN)
		}
		if err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		if isSlotInUse(err) {
			return nil
		}
		return fmt.Errorf("read what slot %q replays up to the stream's last position %s: %w", cfg.Slot, r.tip.CommitLSN, err)
	}
	// The peek stopped after the record that passed the tip's commit.
	return r.walEnd(r.tip.CommitLSN + 1)
}
