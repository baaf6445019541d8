package replication

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/rs/zerolog"
)

// This file is jetbox repair's side of Postgres: the new slot with an
// exported snapshot, and the outbox rows visible in that snapshot.
//
// CREATE_REPLICATION_SLOT ... EXPORT_SNAPSHOT returns the slot's consistent
// point C and a snapshot that sees exactly the transactions whose commit
// record precedes C. The slot streams exactly the transactions whose commit
// record starts at or after C (SnapBuildXactNeedsSkip skips a commit whose
// start is below start_decoding_at, which is C for a new slot). So the rows
// of the snapshot plus the rows the slot streams are every committed row,
// once: no gap, no overlap.

// ErrRepairRefused means repair will not touch the slot (it feeds the
// stream, or another process holds it); the error says what to do.
var ErrRepairRefused = errors.New("repair refused")

// RepairMarker is the name of the marker of an unfinished repair of slot: a
// physical slot that reserves no WAL, created before the repair touches the
// logical slot and dropped once every row of its snapshot is stored. While
// it exists, the logical slot was made by a repair that has not finished:
// jetbox run refuses to start (the stream would miss the rest of the
// snapshot) and jetbox repair drops the slot and starts over.
func RepairMarker(slot string) string {
	const prefix = "jetbox_repair_"
	if len(prefix)+len(slot) <= 63 {
		return prefix + slot
	}
	h := fnv.New32a()
	h.Write([]byte(slot))
	return fmt.Sprintf("%s%s_%08x", prefix, slot[:63-len(prefix)-9], h.Sum32())
}

// repairMarker adds an error finding while a repair of the slot is
// unfinished: jetbox run must not start on its slot.
func (c *checker) repairMarker() {
	var n int
	if err := c.conn.QueryRow(c.ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", RepairMarker(c.cfg.Slot)).Scan(&n); err != nil || n == 0 {
		return
	}
	if c.cfg.AutoRepair {
		c.l.Add(check.Warning, "postgres.repair", fmt.Sprintf("a jetbox repair of slot %q is running or was interrupted (marker slot %q exists): jetbox run --on-lost-slot=repair waits for it, or resumes it once no process holds the repair lock", c.cfg.Slot, RepairMarker(c.cfg.Slot)), "")
		return
	}
	c.l.Add(check.Error, "postgres.repair", fmt.Sprintf("a jetbox repair of slot %q is running or was interrupted (marker slot %q exists): the stream misses rows of its snapshot, which the slot will not stream", c.cfg.Slot, RepairMarker(c.cfg.Slot)),
		"let the repair finish, or run jetbox repair again (it is safe to re-run); then start jetbox run")
}

// RepairOptions configure OpenRepair.
type RepairOptions struct {
	// DryRun reads the rows in a plain snapshot of now, creating and
	// dropping nothing.
	DryRun bool
	// CreatedAtColumn orders and filters the rows when track_commit_timestamp
	// is off (and rows without a commit timestamp when it is on).
	CreatedAtColumn string
	// Margin is how much earlier than the range's start a row may have been
	// inserted (the longest transaction plus clock skew): with commit
	// timestamps and a created-at column, a row inserted before since -
	// Margin is out of the range even when an UPDATE committed it again
	// later (the commit timestamp is the last change's).
	Margin time.Duration
	// BrokenHistory says why the existing slot does not continue the
	// stream's history (VerifyHistory's rewind or timeline case: a restore,
	// a failover); repair then drops a valid slot and creates it again.
	BrokenHistory string
	// Lock is the repair lock (LockRepair) the caller holds, if any: the
	// marker is created and the old slot dropped on its connection, so
	// they happen only while the lock is held. Finish drops the marker
	// there too.
	Lock *RepairLock
}

// Repair is an open repair: the new slot's exported snapshot, imported by a
// REPEATABLE READ transaction that reads the outbox rows. The replication
// connection that exported it stays open until Close.
type Repair struct {
	cfg  Config
	log  zerolog.Logger
	repl *pgconn.PgConn // exported the snapshot; nil in a dry run
	conn *pgx.Conn      // the transaction that imported it

	// ConsistentPoint is the new slot's consistent point (0 in a dry run).
	ConsistentPoint pglogrepl.LSN
	// Origin is the new slot's WAL history, for decoder.Event.Origin.
	Origin string
	// CommitTimestamps: track_commit_timestamp is on, rows are ordered and
	// filtered by their commit time.
	CommitTimestamps bool
	// Order describes the row order, e.g. "created_at, id".
	Order string
	// Plan says what was done (or, in a dry run, would be done) to the slot.
	Plan string
	// Refused is set in a dry run when the real repair would refuse.
	Refused error
	// Failover: the slot becomes a failover slot when the repair is done
	// (PostgreSQL 17+).
	Failover bool

	lock      *RepairLock // the repair lock held, if any (RepairOptions.Lock)
	key       string      // SQL of the order key, a timestamptz
	createdAt string      // SQL of the created-at column, "" when the table has none
	margin    time.Duration
	cols      []decoder.TableColumn
	sel       string // the outbox columns, in cols order
}

// OpenRepair prepares a repair of cfg.Slot. It refuses (ErrRepairRefused)
// when the slot is held by a walsender or is a valid slot no unfinished
// repair left; it drops a slot left by an interrupted repair or invalidated
// (wal_status lost). Then it creates the marker (RepairMarker), the
// publication if missing, and the slot (a failover slot on PostgreSQL 17+)
// with an exported snapshot, and imports the snapshot. In a dry run it only
// describes what it would do and opens a snapshot of now.
func OpenRepair(ctx context.Context, connString string, cfg Config, opt RepairOptions, log zerolog.Logger) (_ *Repair, err error) {
	pcfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", err)
	}
	for k, v := range pinnedParams {
		pcfg.RuntimeParams[k] = v
	}
	pcfg.RuntimeParams["application_name"] = "jetbox repair"
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	r := &Repair{cfg: cfg, conn: conn, margin: opt.Margin, log: log.With().Str("component", "repair").Str("slot", cfg.Slot).Logger()}
	defer func() {
		if err != nil {
			r.Close(context.WithoutCancel(ctx))
		}
	}()

	var versionNum int
	var commitTS, inRecovery bool
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version_num')::int, current_setting('track_commit_timestamp')::bool, pg_is_in_recovery()`).
		Scan(&versionNum, &commitTS, &inRecovery); err != nil {
		return nil, fmt.Errorf("read server settings: %w", err)
	}
	if inRecovery {
		return nil, fmt.Errorf("%w: the server is a standby: point --postgres-url at the primary", ErrRepairRefused)
	}
	r.CommitTimestamps = commitTS
	if err := r.columns(ctx, opt.CreatedAtColumn); err != nil {
		return nil, err
	}

	plan, drop, refused, err := r.slotPlan(ctx, opt.BrokenHistory)
	if err != nil {
		return nil, err
	}
	r.Plan = plan
	if opt.DryRun {
		r.Refused = refused
		if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"); err != nil {
			return nil, fmt.Errorf("begin snapshot transaction: %w", err)
		}
		return r, nil
	}
	if refused != nil {
		return nil, refused
	}

	r.lock = opt.Lock
	marker := RepairMarker(cfg.Slot)
	if _, err := r.markerConn().Exec(ctx, "SELECT pg_create_physical_replication_slot($1)", marker); err != nil && !isDuplicate(err) {
		return nil, fmt.Errorf("create the repair marker (physical slot %q, reserves no WAL): %w", marker, err)
	}
	if drop {
		if _, err := r.markerConn().Exec(ctx, "SELECT pg_drop_replication_slot($1)", cfg.Slot); err != nil {
			return nil, fmt.Errorf("drop slot %q: %w", cfg.Slot, err)
		}
		r.log.Warn().Msg("dropped the slot: " + plan)
	}
	if err := ensurePublication(ctx, conn, cfg, r.log); err != nil {
		return nil, err
	}

	cc, err := replicationConfig(connString)
	if err != nil {
		return nil, err
	}
	cc.RuntimeParams["application_name"] = "jetbox repair"
	if r.repl, err = pgconn.ConnectConfig(ctx, cc); err != nil {
		return nil, fmt.Errorf("connect for replication: %w", err)
	}
	// Before the slot: any command after CREATE_REPLICATION_SLOT on this
	// connection ends the exported snapshot.
	sys, err := pglogrepl.IdentifySystem(ctx, r.repl)
	if err != nil {
		return nil, fmt.Errorf("identify system: %w", err)
	}
	r.Origin = sourceOf(sys, cfg.Slot)
	// On PostgreSQL 17+ jetbox run's slots are failover slots; the
	// repair's becomes one only when the repair is done (Finish). The
	// marker is a physical slot, which a standby never gets: a failover
	// during the repair must not leave the promoted server with the slot
	// and without the marker (jetbox run would stream from it, and the rest
	// of the snapshot would be lost). Without the slot there, run stops
	// with the lost-slot error and a re-run of the repair starts over.
	r.Failover = versionNum >= 170000
	res, err := pglogrepl.CreateReplicationSlot(ctx, r.repl, quoteIdent(cfg.Slot), "pgoutput",
		pglogrepl.CreateReplicationSlotOptions{Mode: pglogrepl.LogicalReplication, SnapshotAction: "EXPORT_SNAPSHOT"})
	if err != nil {
		return nil, fmt.Errorf("create replication slot %q with an exported snapshot: %w", cfg.Slot, err)
	}
	if r.ConsistentPoint, err = pglogrepl.ParseLSN(res.ConsistentPoint); err != nil {
		return nil, fmt.Errorf("parse the consistent point %q of slot %q: %w", res.ConsistentPoint, cfg.Slot, err)
	}
	if _, err := conn.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY"); err != nil {
		return nil, fmt.Errorf("begin snapshot transaction: %w", err)
	}
	if _, err := conn.Exec(ctx, "SET TRANSACTION SNAPSHOT "+quoteLiteral(res.SnapshotName)); err != nil {
		return nil, fmt.Errorf("import snapshot %q: %w", res.SnapshotName, err)
	}
	r.log.Info().Str("lsn", r.ConsistentPoint.String()).Str("snapshot", res.SnapshotName).Bool("failover", r.Failover).
		Str("source", r.Origin).Msg("created the slot with an exported snapshot: rows committed before its consistent point are read from the table, later ones come from the slot")
	return r, nil
}

// columns reads the outbox columns' types (as pgoutput's Relation message
// gives them, domains resolved: see readColumns), refuses a table check
// refuses, and picks the order key.
func (r *Repair) columns(ctx context.Context, createdAt string) error {
	d := r.cfg.Decoder
	tc, err := readColumns(ctx, r.conn.PgConn(), r.cfg)
	if err != nil {
		return err
	}
	all := tc.cols
	_, problems := decoder.CheckColumns(d.Columns, all)
	if len(problems) > 0 {
		return fmt.Errorf("%w: table %s: %s; fix: alter the table to match the outbox DDL in the README, or set the --*-column flags", ErrRepairRefused, r.cfg.qualifiedTable(), strings.Join(problems, "; "))
	}
	// What the stream cannot read, repair does not publish either: the
	// rows after its snapshot would stop jetbox run.
	if len(tc.problems) > 0 {
		var msgs []string
		for _, p := range tc.problems {
			msgs = append(msgs, p.msg+"; fix: "+p.fix)
		}
		return fmt.Errorf("%w: table %s: %s", ErrRepairRefused, r.cfg.qualifiedTable(), strings.Join(msgs, "; "))
	}
	hasCreatedAt := false
	var sel []string
	for _, want := range []string{d.Columns.ID, d.Columns.AggregateType, d.Columns.AggregateID, d.Columns.EventType, d.Columns.Payload, d.Columns.Headers} {
		for _, c := range all {
			if c.Name == want && want != "" {
				r.cols = append(r.cols, c)
				sel = append(sel, pgx.Identifier{c.Name}.Sanitize())
			}
		}
	}
	for _, c := range all {
		if c.Name == createdAt && createdAt != "" {
			hasCreatedAt = true
		}
	}
	r.sel = strings.Join(sel, ", ")
	ca := pgx.Identifier{createdAt}.Sanitize()
	if hasCreatedAt {
		r.createdAt = ca + "::timestamptz"
	}
	switch {
	case r.CommitTimestamps && hasCreatedAt:
		// Rows older than the commit timestamps (frozen, or from before the
		// setting was on) have none: their created_at stands in.
		r.key, r.Order = "coalesce(pg_xact_commit_timestamp(xmin), "+ca+"::timestamptz)", "commit timestamp (else "+createdAt+"), then "+d.Columns.ID
	case r.CommitTimestamps:
		r.key, r.Order = "pg_xact_commit_timestamp(xmin)", "commit timestamp (rows without one first), then "+d.Columns.ID
	case hasCreatedAt:
		r.key, r.Order = ca+"::timestamptz", createdAt+", then "+d.Columns.ID
	default:
		return fmt.Errorf("%w: table %s has no column %q and track_commit_timestamp is off, so repair cannot order the rows; fix: set --created-at-column to the insert-time column, or turn track_commit_timestamp on (restart needed)",
			ErrRepairRefused, r.cfg.qualifiedTable(), createdAt)
	}
	return nil
}

// slotPlan decides what to do with an existing slot.
func (r *Repair) slotPlan(ctx context.Context, brokenHistory string) (plan string, drop bool, refused error, err error) {
	var exists, active, lost, marker bool
	var pid *int32
	var confirmed string
	err = r.conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1),
		coalesce((SELECT active FROM pg_replication_slots WHERE slot_name = $1), false),
		(SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1),
		coalesce((SELECT wal_status = 'lost' OR (to_jsonb(s) ->> 'conflicting')::bool OR (to_jsonb(s) ->> 'invalidation_reason') IS NOT NULL
			FROM pg_replication_slots s WHERE slot_name = $1), false),
		coalesce((SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1), ''),
		EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $2)`, r.cfg.Slot, RepairMarker(r.cfg.Slot)).
		Scan(&exists, &active, &pid, &lost, &confirmed, &marker)
	if err != nil {
		return "", false, nil, fmt.Errorf("read slot %q: %w", r.cfg.Slot, err)
	}
	slot := r.cfg.Slot
	switch {
	case !exists:
		return fmt.Sprintf("slot %q does not exist: repair creates it", slot), false, nil, nil
	case active:
		p := int32(0)
		if pid != nil {
			p = *pid
		}
		return fmt.Sprintf("slot %q is in use (walsender pid %d)", slot, p), false,
			fmt.Errorf("%w: slot %q is in use by walsender pid %d (a running jetbox run?): it feeds the stream; stop that process first if you mean to repair", ErrRepairRefused, slot, p), nil
	case marker:
		return fmt.Sprintf("slot %q was left by an interrupted repair (marker %q): repair drops it and starts over", slot, RepairMarker(slot)), true, nil, nil
	case lost:
		return fmt.Sprintf("slot %q is invalidated: repair drops it and creates it again", slot), true, nil, nil
	case brokenHistory != "":
		return fmt.Sprintf("slot %q does not continue the stream's history (%s): repair drops it and creates it again", slot, brokenHistory), true, nil, nil
	default:
		return fmt.Sprintf("slot %q exists (confirmed to %s) and feeds the stream", slot, confirmed), false,
			fmt.Errorf("%w: slot %q exists, is valid and was not left by an interrupted repair (confirmed to %s): jetbox run streams from it; if rows are missing anyway (outbox rows written before the slot was created), stop jetbox run, drop the slot (SELECT pg_drop_replication_slot('%s')), then run jetbox repair: it creates the slot again and publishes what the stream misses", ErrRepairRefused, slot, confirmed, slot), nil
	}
}

func ensurePublication(ctx context.Context, conn *pgx.Conn, cfg Config, log zerolog.Logger) error {
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_publication WHERE pubname = $1", cfg.Publication).Scan(&n); err != nil {
		return fmt.Errorf("look up publication %q: %w", cfg.Publication, err)
	}
	if n > 0 {
		return nil
	}
	if err := createPublication(ctx, conn, cfg); err != nil {
		return err
	}
	log.Info().Str("publication", cfg.Publication).Str("table", cfg.qualifiedTable()).Msg("created publication")
	return nil
}

// Columns returns the outbox columns, in the order Rows gives their values.
func (r *Repair) Columns() []decoder.TableColumn { return r.cols }

func (r *Repair) where(since time.Time) string {
	if since.IsZero() {
		return ""
	}
	w := " WHERE " + r.key + " >= " + quoteLiteral(since.UTC().Format(time.RFC3339Nano)) + "::timestamptz"
	if r.CommitTimestamps && r.createdAt != "" {
		w += " AND " + r.createdAt + " >= " + quoteLiteral(since.Add(-r.margin).UTC().Format(time.RFC3339Nano)) + "::timestamptz"
	}
	return w
}

// Count returns the number of rows at or after since (zero: all rows).
func (r *Repair) Count(ctx context.Context, since time.Time) (int64, error) {
	var n int64
	if err := r.conn.QueryRow(ctx, "SELECT count(*) FROM "+r.cfg.quotedTable()+r.where(since)).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the outbox rows: %w", err)
	}
	return n, nil
}

// Rows calls fn for every row at or after since (zero: all rows), in the
// repair order (Order): the order key, then the id. values are the outbox
// columns' text output, nil for NULL, in Columns order, valid during the
// call only; key is the row's order key and inserted its created-at time
// (zero when the table has no such column). An error from fn stops the
// scan.
func (r *Repair) Rows(ctx context.Context, since time.Time, fn func(values [][]byte, key, inserted time.Time) error) error {
	ins := "NULL::bigint"
	if r.createdAt != "" {
		ins = "(extract(epoch FROM " + r.createdAt + ") * 1000000)::bigint"
	}
	q := "SELECT (extract(epoch FROM " + r.key + ") * 1000000)::bigint, " + ins + ", " + r.sel + " FROM " + r.cfg.quotedTable() +
		r.where(since) + " ORDER BY 1 NULLS FIRST, " + pgx.Identifier{r.cfg.Decoder.Columns.ID}.Sanitize()
	rows, err := r.conn.Query(ctx, q, pgx.QueryResultFormats{pgx.TextFormatCode})
	if err != nil {
		return fmt.Errorf("read the outbox rows: %w", err)
	}
	defer rows.Close()
	micros := func(b []byte, what string) (time.Time, error) {
		if b == nil {
			return time.Time{}, nil
		}
		us, err := strconv.ParseInt(string(b), 10, 64)
		if err != nil {
			return time.Time{}, fmt.Errorf("parse the %s %q: %w", what, b, err)
		}
		return time.UnixMicro(us).UTC(), nil
	}
	for rows.Next() {
		raw := rows.RawValues()
		key, err := micros(raw[0], "order key")
		if err != nil {
			return err
		}
		inserted, err := micros(raw[1], "created-at time")
		if err != nil {
			return err
		}
		if err := fn(raw[2:], key, inserted); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read the outbox rows: %w", err)
	}
	return nil
}

// Finish ends a repair whose rows are all stored: it drops the marker, so
// jetbox run may stream from the slot, and closes the connections.
func (r *Repair) Finish(ctx context.Context) error {
	if r.repl == nil {
		r.Close(ctx)
		return nil
	}
	if _, err := r.conn.Exec(ctx, "COMMIT"); err != nil {
		return fmt.Errorf("end the snapshot transaction: %w", err)
	}
	if r.Failover {
		// Then the marker goes: a failover from here on either finds the
		// slot synced (every row of the snapshot is in the stream) or not
		// there at all (run stops: lost slot).
		if _, err := r.repl.Exec(ctx, "ALTER_REPLICATION_SLOT "+quoteIdent(r.cfg.Slot)+" (FAILOVER true)").ReadAll(); err != nil {
			return fmt.Errorf("make slot %q a failover slot: %w", r.cfg.Slot, err)
		}
	}
	if _, err := r.markerConn().Exec(ctx, "SELECT pg_drop_replication_slot($1)", RepairMarker(r.cfg.Slot)); err != nil {
		return fmt.Errorf("drop the repair marker %q: %w", RepairMarker(r.cfg.Slot), err)
	}
	r.Close(ctx)
	return nil
}

// markerConn is the connection the marker is changed on: the repair lock's
// when one is held (a statement there proves the lock still is), else the
// repair's own.
func (r *Repair) markerConn() *pgx.Conn {
	if r.lock != nil && r.lock.conn != nil {
		return r.lock.conn
	}
	return r.conn
}

// Close closes the connections; the marker and the slot stay.
func (r *Repair) Close(ctx context.Context) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if r.repl != nil {
		_ = r.repl.Close(cctx)
	}
	if r.conn != nil {
		_ = r.conn.Close(cctx)
	}
}
