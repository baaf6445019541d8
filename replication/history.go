package replication

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jetbox-dev/jetbox/sink/format"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/rs/zerolog"
)

// StreamTip is where the stream's history of this database ends: its last
// jetbox message (see sink.Tip).
type StreamTip struct {
	Seq        uint64
	Origin     string // Jetbox-Source: <system id>/<timeline>/<database>/<slot>
	CommitLSN  pglogrepl.LSN
	TxIndex    int    // Jetbox-Tx-Index
	ID         string // Nats-Msg-Id
	RowID      string // Jetbox-Row-Id: a dead letter's row (its id when the sink refused it)
	CommitTime string
	Scheme     string // how its Jetbox-Tx-Index counted (decoder.Config.IndexScheme)
	Routing    string // Jetbox-Routing: how it was routed and stored (decoder.Config.RoutingHeader)
	TxLast     bool   // Jetbox-Tx-Last: the last message of an atomic transaction
	// AggregateType, AggregateID and EventType are what its subject was
	// rendered from.
	AggregateType, AggregateID, EventType string
	Stored                                time.Time // when the server stored it
	// RepairSince is set on a message of jetbox repair: where its range started.
	RepairSince string
	Subject     string
}

// TipSource is a Sink that can read the stream's tip. The streamer compares
// it with the server at every session open (see VerifyHistory); with
// AcceptLostRows, Forget is called with the tip an accepted loss abandons
// and the slot's position, where the slot's replay of it starts.
type TipSource interface {
	// Tip returns the last message that writer (format.Origin.Writer)
	// stored on jetbox's subjects.
	Tip(ctx context.Context, writer string) (StreamTip, bool, error)
	Forget(tip StreamTip, from pglogrepl.LSN)
}

// History cases: why the stream's history and the server's part.
const (
	CaseLostSlot = "lost-slot"         // the stream holds rows of this database, the slot is gone
	CaseRewind   = "rewind"            // the stream is ahead of the server's WAL on the same timeline
	CaseTimeline = "timeline"          // the server's timeline does not continue the stream's after its last row
	CaseRepair   = "unfinished-repair" // a jetbox repair of the slot has not finished (its marker exists)
)

// HistoryError says the server cannot continue the stream's history: rows
// committed after the stream's last one may be missing, and only a repair
// from the table can tell. jetbox stops on it (exit 2).
type HistoryError struct {
	Case   string
	Tip    StreamTip
	Detail string
	// NoTable: the outbox is logical decoding messages only
	// (--source=messages), which no repair can re-read.
	NoTable bool
	// LostCause says, for CaseLostSlot, why the slot is not there:
	// LostPromotion, LostInvalidated or LostDropped.
	LostCause string
	// Branched (CaseLostSlot, LostPromotion): the server's timeline left
	// the stream's before the stream's last position, so the stream may
	// hold rows this server never got.
	Branched bool
}

// Causes of a lost slot (HistoryError.LostCause).
const (
	// LostPromotion: the slot is missing on a server of a later timeline
	// than the stream's last message (a standby promoted without it).
	LostPromotion = "promotion"
	// LostInvalidated: the slot exists but Postgres invalidated it
	// (wal_status lost, a conflict with recovery).
	LostInvalidated = "invalidated"
	// LostDropped: the slot is missing on the stream's own timeline.
	LostDropped = "dropped"
)

// LostCauses returns every HistoryError.LostCause.
func LostCauses() []string { return []string{LostPromotion, LostInvalidated, LostDropped} }

func (e *HistoryError) Error() string {
	next := "run `jetbox repair` with the same configuration to re-publish them from the table, then start jetbox again " +
		"(or, to accept the loss, restart with --accept-lost-rows)"
	if e.NoTable {
		next = "with --source=messages they exist only in the WAL, which this server does not hold: have the producers emit the events " +
			"committed since then again (with their ids: the stream drops those it holds while they are inside its duplicate window), " +
			"then restart with --accept-lost-rows"
	}
	return fmt.Sprintf("%s: %s; outbox events committed after %s (commit LSN %s, the stream's last jetbox message, seq %d) may be missing from the stream: %s",
		e.Case, e.Detail, e.Tip.CommitTime, e.Tip.CommitLSN, e.Tip.Seq, next)
}

// withSource marks a *HistoryError in err with what cfg's outbox can be
// repaired from, and returns err.
func withSource(err error, cfg Config) error {
	var he *HistoryError
	if errors.As(err, &he) {
		he.NoTable = !cfg.hasTable()
	}
	return err
}

// Permanent marks the error as one to stop on.
func (e *HistoryError) Permanent() bool { return true }

// sourceOf is the WAL history an event comes from (decoder.Event.Origin).
func sourceOf(sys pglogrepl.IdentifySystemResult, slot string) string {
	return format.Origin{SystemID: sys.SystemID, Timeline: sys.Timeline, Database: sys.DBName, Slot: slot}.String()
}

// server is what VerifyHistory needs to know about Postgres.
type server struct {
	sys      pglogrepl.IdentifySystemResult
	slot     bool // the slot exists and is not invalidated
	lostSlot bool // the slot exists but is invalidated
	// lostCause is why (invalidationSQL: wal_removed, rows_removed...).
	lostCause string
	marker    bool // a repair of the slot has not finished (RepairMarker exists)
	// recovery: the server is a standby; synced: the slot is a copy that
	// sync_replication_slots keeps (PostgreSQL 17+), which cannot stream.
	recovery, synced bool
	history          func(ctx context.Context, timeline int32) ([]byte, error)
}

// verify compares the stream's tip with the server; a nil error means the
// server continues the stream's history (or the stream holds no jetbox
// message from this database: a first start).
func verify(ctx context.Context, tip StreamTip, haveTip bool, srv server, slot string) error {
	if srv.marker {
		// Checked at every session open: the repair's slot may be valid,
		// the stream's tip its own, and the rest of its snapshot missing.
		return &HistoryError{Case: CaseRepair, Tip: tip, Detail: fmt.Sprintf(
			"a jetbox repair of slot %q is running or was interrupted (its marker, physical slot %q, exists): the stream misses rows of its snapshot, which the slot does not stream",
			slot, RepairMarker(slot))}
	}
	if !haveTip {
		return nil
	}
	src, ok := format.ParseOrigin(tip.Origin)
	if !ok || src.SystemID != srv.sys.SystemID || src.Database != srv.sys.DBName || src.Slot != slot {
		return nil // not this database's history
	}
	if !srv.slot {
		what := "does not exist"
		if srv.lostSlot {
			what = "is invalidated (wal_status lost)"
			if srv.lostCause != "" {
				what = describeInvalidation(srv.lostCause)
			}
		}
		he := &HistoryError{Case: CaseLostSlot, Tip: tip, LostCause: LostDropped, Detail: fmt.Sprintf(
			"replication slot %q %s on this server (timeline %d) while the stream holds jetbox messages from it (a failover to a server without the slot, or the slot was dropped): a new slot would start at the server's current position",
			slot, what, srv.sys.Timeline)}
		switch {
		case srv.lostSlot:
			he.LostCause = LostInvalidated
		case src.Timeline < srv.sys.Timeline:
			he.LostCause = LostPromotion
			he.Branched = branchedBefore(ctx, srv, src.Timeline, tip.CommitLSN)
			if he.Branched {
				he.Detail += fmt.Sprintf("; the server's timeline %d left the stream's timeline %d before the stream's last position %s: the stream may hold rows this server never got", srv.sys.Timeline, src.Timeline, tip.CommitLSN)
			}
		}
		return he
	}
	if src.Timeline == srv.sys.Timeline {
		if tip.CommitLSN >= srv.sys.XLogPos && srv.recovery {
			// A standby reports what it has replayed: after a restart it
			// replays its own WAL, from before the tip, before it streams.
			return fmt.Errorf("%w: the standby has replayed up to %s, not yet past the stream's last position %s on timeline %d: waiting for it (a standby that restarted, or lags)",
				errStandbyBehind, srv.sys.XLogPos, tip.CommitLSN, srv.sys.Timeline)
		}
		if tip.CommitLSN >= srv.sys.XLogPos {
			return &HistoryError{Case: CaseRewind, Tip: tip, Detail: fmt.Sprintf(
				"the stream's last position %s is ahead of the server's WAL position %s on the same timeline %d (the server was restored from a snapshot or backup, or rewound): rows committed since reuse positions the stream already holds",
				tip.CommitLSN, srv.sys.XLogPos, srv.sys.Timeline)}
		}
		return nil
	}
	if src.Timeline > srv.sys.Timeline {
		return &HistoryError{Case: CaseTimeline, Tip: tip, Detail: fmt.Sprintf(
			"the server is on timeline %d, older than the stream's timeline %d (restored from before a failover?)", srv.sys.Timeline, src.Timeline)}
	}
	content, err := srv.history(ctx, srv.sys.Timeline)
	if err != nil {
		return fmt.Errorf("read the history of timeline %d: %w", srv.sys.Timeline, err)
	}
	switchpoint, found, err := branchPoint(content, src.Timeline)
	if err != nil {
		return fmt.Errorf("timeline %d history: %w", srv.sys.Timeline, err)
	}
	if !found {
		return &HistoryError{Case: CaseTimeline, Tip: tip, Detail: fmt.Sprintf(
			"the server's timeline %d does not descend from the stream's timeline %d", srv.sys.Timeline, src.Timeline)}
	}
	// The switch point is a record boundary: the commit record starting at
	// the tip's LSN is on the new timeline only if it starts before it.
	if switchpoint <= tip.CommitLSN {
		return &HistoryError{Case: CaseTimeline, Tip: tip, Detail: fmt.Sprintf(
			"the server's timeline %d branched from the stream's timeline %d at %s, before the stream's last position %s (a failover lost transactions the stream holds; rows committed since reuse their positions)",
			srv.sys.Timeline, src.Timeline, switchpoint, tip.CommitLSN)}
	}
	return nil
}

// branchedBefore reports whether the server's timeline history shows it
// left timeline tl at or before lsn (false when it cannot tell).
func branchedBefore(ctx context.Context, srv server, tl int32, lsn pglogrepl.LSN) bool {
	if srv.history == nil {
		return false
	}
	content, err := srv.history(ctx, srv.sys.Timeline)
	if err != nil {
		return false
	}
	switchpoint, found, err := branchPoint(content, tl)
	return err == nil && found && switchpoint <= lsn
}

// branchPoint finds in a timeline history file where timeline tl ended
// (the lines are "<parent timeline>\t<switch point>\t<reason>").
func branchPoint(content []byte, tl int32) (pglogrepl.LSN, bool, error) {
	sc := bufio.NewScanner(bytes.NewReader(content))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) < 2 {
			return 0, false, fmt.Errorf("malformed line %q", line)
		}
		parent, err := strconv.ParseInt(f[0], 10, 32)
		if err != nil {
			return 0, false, fmt.Errorf("malformed line %q: %w", line, err)
		}
		if int32(parent) != tl {
			continue
		}
		lsn, err := pglogrepl.ParseLSN(f[1])
		if err != nil {
			return 0, false, fmt.Errorf("malformed line %q: %w", line, err)
		}
		return lsn, true, nil
	}
	return 0, false, sc.Err()
}

// errStandbyBehind: a standby has not replayed up to the stream's tip yet,
// which it will (retried, not a history break).
var errStandbyBehind = errors.New("the standby is behind the stream")

// readServer gathers, over a replication connection, what verify needs.
func readServer(ctx context.Context, conn *pgconn.PgConn, slot string) (server, error) {
	sys, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return server{}, fmt.Errorf("identify system: %w", err)
	}
	// One row: the slot's wal_status ("-": no slot), and whether a repair's
	// marker exists (with or without the slot: a repair killed before it
	// created the slot).
	res, err := conn.Exec(ctx, "SELECT coalesce((SELECT "+invalidationSQL+" FROM pg_replication_slots s WHERE slot_name = "+quoteLiteral(slot)+
		"), '-'), EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = "+quoteLiteral(RepairMarker(slot))+"), pg_is_in_recovery(), "+
		"EXISTS (SELECT 1 FROM pg_replication_slots s WHERE slot_name = "+quoteLiteral(slot)+" AND coalesce((to_jsonb(s) ->> 'synced')::bool, false))").ReadAll()
	if err != nil {
		return server{}, fmt.Errorf("read slot %q: %w", slot, err)
	}
	srv := server{sys: sys, history: func(ctx context.Context, tl int32) ([]byte, error) {
		h, err := pglogrepl.TimelineHistory(ctx, conn, tl)
		return h.Content, err
	}}
	if len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 4 {
		return server{}, fmt.Errorf("read slot %q: unexpected result", slot)
	}
	row := res[0].Rows[0]
	srv.lostCause = string(row[0])
	if srv.lostCause == "-" {
		srv.lostCause = ""
	}
	srv.lostSlot = srv.lostCause != ""
	srv.slot = string(row[0]) != "-" && !srv.lostSlot
	srv.marker = string(row[1]) == "t"
	srv.recovery, srv.synced = string(row[2]) == "t", string(row[3]) == "t"
	if srv.recovery && srv.synced {
		return server{}, &PermanentError{Err: fmt.Errorf("replication slot %q on this standby is a copy that sync_replication_slots keeps in step with the primary's slot of that name: a standby cannot stream from such a copy", slot),
			Hint: "to decode on this standby give jetbox a slot of its own (--slot) and hot_standby_feedback; to keep decoding on the primary point --postgres-url at the primary (the copy takes over at a promotion)"}
	}
	return srv, nil
}

// checkHistory runs verify on conn; with accept it logs the loss and, for a
// rewind or timeline break, has the sink forget the abandoned positions. It
// returns the tip it checked; ok is false when there is none, or it belongs
// to a history an accepted loss abandoned.
func checkHistory(ctx context.Context, conn *pgconn.PgConn, cfg Config, ts TipSource, log zerolog.Logger) (srv server, tip StreamTip, ok bool, err error) {
	// The tip first, then the server: the server's position is then at
	// least any position the stream holds (another instance may publish
	// meanwhile).
	if ts != nil {
		sys, err := pglogrepl.IdentifySystem(ctx, conn)
		if err != nil {
			return server{}, StreamTip{}, false, fmt.Errorf("identify system: %w", err)
		}
		writer := format.Origin{SystemID: sys.SystemID, Database: sys.DBName, Slot: cfg.Slot}.Writer()
		if tip, ok, err = ts.Tip(ctx, writer); err != nil {
			return server{}, StreamTip{}, false, fmt.Errorf("read the stream's last jetbox message: %w", err)
		}
	}
	if srv, err = readServer(ctx, conn, cfg.Slot); err != nil {
		return srv, StreamTip{}, false, err
	}
	err = withSource(verify(ctx, tip, ok, srv, cfg.Slot), cfg)
	var he *HistoryError
	if errors.As(err, &he) && acceptable(he, cfg) {
		log.Warn().Str("case", he.Case).Str("after_commit_time", tip.CommitTime).Str("after_lsn", tip.CommitLSN.String()).
			Str("detail", he.Detail).Msg("--accept-lost-rows: going on; rows committed after this point may be missing from the stream (jetbox repair re-publishes them from the table)")
		from := tip.CommitLSN + 1 // a new slot replays none of it
		if srv.slot {
			if from, err = slotPosition(ctx, conn, cfg.Slot); err != nil {
				return srv, StreamTip{}, false, err
			}
		}
		ts.Forget(tip, from)
		return srv, StreamTip{}, false, nil
	}
	return srv, tip, ok, err
}

// ownTip reports whether the tip comes from this database and slot (on any
// timeline: verify checked the server continues it).
func ownTip(tip StreamTip, sys pglogrepl.IdentifySystemResult, slot string) bool {
	src, ok := format.ParseOrigin(tip.Origin)
	return ok && src.SystemID == sys.SystemID && src.Database == sys.DBName && src.Slot == slot
}

// checkScheme refuses to count a transaction's events under another scheme
// than the stream's last message did (decoder.Config.IndexScheme) when that
// message's transaction will be read again: replication restarts at the
// slot's confirmed position start, and a transaction committed at or after
// it (one acked in part at a stop, or before a crash) is replayed. Its
// events' Jetbox-Tx-Index values would shift, and a position check would
// skip a row the stream lacks (a lost row) or take a stored one for a new
// one. A change after a clean stop (the tip's commit before start) is safe.
func checkScheme(tip StreamTip, current string, start pglogrepl.LSN) error {
	if tip.Scheme == current || tip.CommitLSN < start {
		return nil
	}
	return &PermanentError{
		Err: fmt.Errorf("the stream's last transaction (commit LSN %s, committed at %s) was stored, in part or whole, under %s, and the slot replays it (confirmed position %s), while this run counts a transaction's rows and messages differently (%s): its events' Jetbox-Tx-Index would shift, so a stored row could be taken for a new one or a row the stream lacks be skipped as a replay",
			tip.CommitLSN, tip.CommitTime, describeScheme(tip.Scheme), start, describeScheme(current)),
		Hint: fmt.Sprintf("restart once with %s until that transaction is confirmed (a clean stop after it), then change --source or --message-prefix", describeScheme(tip.Scheme)),
	}
}

// describeScheme spells an index scheme as the flags that give it.
func describeScheme(scheme string) string {
	src, prefix, ok := strings.Cut(scheme, ":")
	if scheme == "" || !ok {
		return "--source=table"
	}
	return "--source=" + src + " --message-prefix=" + prefix
}

// VerifyHistory compares the stream's tip (from ts) with the server before
// jetbox creates anything: a missing slot is created only on a first start
// (the stream holds no jetbox message from this database), and a server
// that does not continue the stream's history stops jetbox with a
// *HistoryError, unless cfg.AcceptLostRows. It returns the tip it checked
// (ok: there is one of this database and slot).
func VerifyHistory(ctx context.Context, connString string, cfg Config, ts TipSource, log zerolog.Logger) (tip StreamTip, ok bool, err error) {
	cc, err := replicationConfig(connString)
	if err != nil {
		return StreamTip{}, false, err
	}
	conn, err := pgconn.ConnectConfig(ctx, cc)
	if err != nil {
		return StreamTip{}, false, fmt.Errorf("%w: connect for replication: %w", ErrUnreachable, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	srv, tip, ok, err := checkHistory(ctx, conn, cfg, ts, log)
	ok = ok && ownTip(tip, srv.sys, cfg.Slot)
	if err != nil || !ok || !srv.slot {
		return tip, ok, err
	}
	start, err := slotPosition(ctx, conn, cfg.Slot)
	if err != nil {
		return tip, ok, err
	}
	err = withSource(peekReplay(ctx, connString, cfg, newTipReplay(tip, start)), cfg)
	var he *HistoryError
	if errors.As(err, &he) && acceptable(he, cfg) {
		log.Warn().Str("case", he.Case).Str("after_commit_time", tip.CommitTime).Str("after_lsn", tip.CommitLSN.String()).
			Str("detail", he.Detail).Msg("--accept-lost-rows: going on; rows committed after this point may be missing from the stream (jetbox repair re-publishes them from the table)")
		ts.Forget(tip, start)
		return StreamTip{}, false, nil
	}
	return tip, ok, err
}

// acceptable reports whether --accept-lost-rows lets jetbox go on past he.
// Never past an unfinished repair: it is not a loss to accept but rows on
// their way, and streaming from its slot would store later rows before
// them and confirm past the rest of its snapshot.
func acceptable(he *HistoryError, cfg Config) bool {
	return cfg.AcceptLostRows && he.Case != CaseRepair
}
