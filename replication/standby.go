package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/rs/zerolog"
)

// standbyMinVersion is the first PostgreSQL version (server_version_num)
// that decodes on a hot standby.
const standbyMinVersion = 160000

// serverLSNSQL is the server's WAL position: the primary's insert position,
// a standby's replay position (pg_current_wal_lsn fails in recovery).
const serverLSNSQL = "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END"

// invalidationSQL is why the slot s (a row of pg_replication_slots) is
// invalidated, ” when it is valid: invalidation_reason (17+), conflicting
// (16: a conflict with recovery on a standby, rows_removed or
// wal_level_insufficient) or wal_status lost. to_jsonb reads the columns
// a version lacks as NULL.
const invalidationSQL = `CASE WHEN (to_jsonb(s) ->> 'invalidation_reason') IS NOT NULL THEN to_jsonb(s) ->> 'invalidation_reason'
	WHEN coalesce((to_jsonb(s) ->> 'conflicting')::bool, false) THEN 'conflict'
	WHEN s.wal_status = 'lost' THEN 'wal_removed' ELSE '' END`

// describeInvalidation says what an invalidation reason (invalidationSQL)
// means.
func describeInvalidation(reason string) string {
	switch reason {
	case "wal_removed":
		return "is invalidated (wal_status lost): Postgres removed WAL it still needed"
	case "rows_removed":
		return "is invalidated by a conflict with recovery on this standby (invalidation_reason rows_removed): the primary removed catalog rows the slot still needed (hot_standby_feedback off, or no physical slot between the servers while the standby was disconnected)"
	case "wal_level_insufficient":
		return "is invalidated by a conflict with recovery on this standby (invalidation_reason wal_level_insufficient): the primary's wal_level was lowered below logical"
	case "conflict":
		return "is invalidated by a conflict with recovery on this standby (conflicting = true: the primary removed catalog rows the slot still needed, with hot_standby_feedback off or no physical slot between the servers, or its wal_level was lowered below logical)"
	default:
		return fmt.Sprintf("is invalidated (invalidation_reason %s)", reason)
	}
}

// standby checks what decoding on a hot standby needs: PostgreSQL 16+,
// hot_standby_feedback and a physical slot on the primary (so it keeps the
// catalog rows the slot needs), and, with --primary-url, the primary.
func (c *checker) standby() {
	var num int
	var feedback, primarySlot string
	err := c.conn.QueryRow(c.ctx, `SELECT current_setting('server_version_num')::int, current_setting('hot_standby_feedback'),
		current_setting('primary_slot_name')`).Scan(&num, &feedback, &primarySlot)
	if err != nil {
		c.fail("postgres.standby", err)
		return
	}
	if num < standbyMinVersion {
		c.l.Add(check.Error, "postgres.primary", fmt.Sprintf("the server is a standby (in recovery) of PostgreSQL %d: logical decoding on a standby needs PostgreSQL 16 or later, so jetbox needs the primary here (slots, publications and heartbeats are written there)", num/10000),
			"point --postgres-url at the primary (the read-write endpoint), or upgrade to PostgreSQL 16+ to decode on the standby (docs/operations.md, \"Decoding from a standby\")")
		return
	}
	c.l.Add(check.Info, "postgres.standby", "the server is a hot standby (PostgreSQL 16+): jetbox creates its slot and decodes here", "")
	if feedback != "on" {
		c.l.Add(check.Error, "postgres.hot_standby_feedback", "hot_standby_feedback is off on this standby: the primary may remove catalog rows jetbox's slot still needs, which invalidates the slot (rows_removed)",
			"on the standby: ALTER SYSTEM SET hot_standby_feedback = on; SELECT pg_reload_conf()")
	}
	if primarySlot == "" {
		c.l.Add(check.Error, "postgres.primary_slot_name", "primary_slot_name is empty on this standby: without a physical slot on the primary, its hot_standby_feedback is forgotten whenever the standby disconnects, and the primary may remove catalog rows jetbox's slot needs",
			"on the primary: SELECT pg_create_physical_replication_slot('standby1'); on the standby: ALTER SYSTEM SET primary_slot_name = 'standby1'; SELECT pg_reload_conf()")
	}
	c.primary()
}

// primary checks --primary-url: reachable, a primary of the same system,
// wal_level = logical, and the role may log standby snapshots.
func (c *checker) primary() {
	if c.cfg.PrimaryURL == "" {
		c.l.Add(check.Info, "postgres.primary_url", "no --primary-url: the primary's wal_level is not checked, no heartbeats are written, a missing publication must be created on the primary by hand, and creating the slot on a quiet primary waits (at most --postgres-timeout) for it to log a running-transactions record",
			"set --primary-url (JETBOX_PRIMARY_URL) to the primary's URL, same database")
		return
	}
	ctx, cancel := context.WithTimeout(c.ctx, 10*time.Second)
	defer cancel()
	pc, err := connect(ctx, c.cfg.PrimaryURL)
	if err != nil {
		c.l.Add(check.Error, "postgres.primary_url", "--primary-url cannot be reached: "+err.Error(),
			"check --primary-url (host, port, user, password, database) and that the primary is up")
		return
	}
	defer pc.Close(context.WithoutCancel(ctx))
	var recovery, snapshot bool
	var walLevel, db, ownDB string
	var sys, own int64
	err = pc.QueryRow(ctx, `SELECT pg_is_in_recovery(), current_setting('wal_level'), (SELECT system_identifier FROM pg_control_system()),
		has_function_privilege('pg_log_standby_snapshot()', 'EXECUTE'), current_database()`).Scan(&recovery, &walLevel, &sys, &snapshot, &db)
	if err == nil {
		err = c.conn.QueryRow(c.ctx, "SELECT system_identifier, current_database() FROM pg_control_system()").Scan(&own, &ownDB)
	}
	if err != nil {
		c.fail("postgres.primary_url", err)
		return
	}
	ok := true
	bad := func(name, what, fix string) {
		c.l.Add(check.Error, name, what, fix)
		ok = false
	}
	if recovery {
		bad("postgres.primary_url", "--primary-url names a server in recovery, not the primary", "point --primary-url at the primary this standby replicates from")
	}
	if sys != own {
		bad("postgres.primary_url", fmt.Sprintf("--primary-url names another cluster (system identifier %d, this standby's is %d)", sys, own), "point --primary-url at the primary this standby replicates from")
	} else if db != ownDB {
		bad("postgres.primary_url", fmt.Sprintf("--primary-url names database %q, --postgres-url %q: the publication and the heartbeats would go to another database than the one jetbox decodes", db, ownDB),
			"give --primary-url the same database as --postgres-url")
	}
	if walLevel != "logical" {
		bad("postgres.primary_wal_level", fmt.Sprintf("wal_level is %q on the primary: a standby decodes only WAL the primary writes at wal_level logical", walLevel),
			"on the primary: ALTER SYSTEM SET wal_level = logical; then restart it")
	}
	if !snapshot {
		bad("postgres.primary_url", "the --primary-url role may not run pg_log_standby_snapshot()", "on the primary: GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO "+pgx.Identifier{c.user()}.Sanitize())
	}
	if ok {
		c.l.Add(check.Info, "postgres.primary_url", "--primary-url reaches the primary (wal_level logical): heartbeats, the publication and standby snapshots go there", "")
	}
}

// ensurePublicationOnPrimary creates the publication on the primary
// (--primary-url; a standby cannot write catalogs) and waits until the
// standby has replayed it.
func ensurePublicationOnPrimary(ctx context.Context, standby *pgx.Conn, cfg Config, log zerolog.Logger) error {
	if cfg.PrimaryURL == "" {
		c := &checker{cfg: cfg}
		return &PermanentError{Err: fmt.Errorf("publication %q is missing, and a standby cannot create it", cfg.Publication),
			Hint: "run on the primary: " + c.publicationSQL() + " (or set --primary-url: jetbox then creates it there)"}
	}
	pc, err := connect(ctx, cfg.PrimaryURL)
	if err != nil {
		return fmt.Errorf("connect to the primary (--primary-url) to create publication %q: %w", cfg.Publication, err)
	}
	defer pc.Close(context.WithoutCancel(ctx))
	var db, ownDB string
	if err := pc.QueryRow(ctx, "SELECT current_database()").Scan(&db); err != nil {
		return fmt.Errorf("read the primary's database: %w", err)
	}
	if err := standby.QueryRow(ctx, "SELECT current_database()").Scan(&ownDB); err != nil {
		return fmt.Errorf("read the standby's database: %w", err)
	}
	if db != ownDB {
		return &PermanentError{Err: fmt.Errorf("--primary-url names database %q, --postgres-url %q: the publication would be created in another database than the one jetbox decodes", db, ownDB),
			Hint: "give --primary-url the same database as --postgres-url"}
	}
	if err := createPublication(ctx, pc, cfg); err != nil {
		return err
	}
	log.Info().Str("publication", cfg.Publication).Msg("created publication on the primary (--primary-url)")
	for {
		var n int
		if err := standby.QueryRow(ctx, "SELECT count(*) FROM pg_publication WHERE pubname = $1", cfg.Publication).Scan(&n); err != nil {
			return fmt.Errorf("wait for publication %q on the standby: %w", cfg.Publication, err)
		}
		if n > 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("publication %q, created on the primary, has not reached the standby: %w (is the standby replaying?)", cfg.Publication, ctx.Err())
		case <-time.After(100 * time.Millisecond): // replay has no event to wait on
		}
	}
}

// ErrStandbySnapshot: creating the slot on a standby waited longer than
// its bound for the primary to log a running-transactions record.
var ErrStandbySnapshot = errors.New("slot creation on the standby timed out")

// createSlotOnStandby creates the logical slot on a standby. The creation
// waits for a running-transactions record from the primary, which a quiet
// primary writes only after other WAL (at most every 15 s): with
// --primary-url, jetbox asks the primary for one (pg_log_standby_snapshot)
// every half second while it waits; without, the wait is bounded by wait.
func createSlotOnStandby(ctx context.Context, conn *pgx.Conn, cfg Config, wait time.Duration) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	done := make(chan struct{})
	defer close(done)
	nudged := make(chan error, 1)
	if cfg.PrimaryURL != "" {
		go func() { nudged <- nudgePrimary(cctx, cfg.PrimaryURL, done) }()
	}
	var pid int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return "", fmt.Errorf("read the backend pid: %w", err)
	}
	var lsn string
	// failover stays false: a standby refuses failover for a slot created on it.
	err := conn.QueryRow(cctx, "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false)", cfg.Slot).Scan(&lsn)
	if err != nil && cctx.Err() != nil {
		// PostgreSQL 16 may not act on the cancel in this wait: end the
		// backend, so it leaves no slot behind when a record comes later
		// (also when jetbox is stopping).
		terminate(context.WithoutCancel(ctx), conn.Config().ConnString(), pid)
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		if cfg.PrimaryURL == "" {
			return "", &PermanentError{Err: fmt.Errorf("%w: creating replication slot %q on the standby waited %s for the primary to log a running-transactions record (a quiet primary logs one only after other WAL)", ErrStandbySnapshot, cfg.Slot, wait),
				Hint: "set --primary-url (JETBOX_PRIMARY_URL) to the primary: jetbox then calls SELECT pg_log_standby_snapshot() there while the creation waits; or run that on the primary yourself, or write to it, while jetbox starts"}
		}
		select {
		case nerr := <-nudged:
			if nerr != nil {
				return "", fmt.Errorf("%w: creating replication slot %q on the standby waited %s; asking the primary for a snapshot failed: %w", ErrStandbySnapshot, cfg.Slot, wait, nerr)
			}
		default:
		}
		return "", fmt.Errorf("%w: creating replication slot %q on the standby waited %s although the primary logged standby snapshots (is the standby replaying?)", ErrStandbySnapshot, cfg.Slot, wait)
	}
	return lsn, err
}

// nudgePrimary calls pg_log_standby_snapshot() on the primary now and
// every half second until done or ctx ends.
func nudgePrimary(ctx context.Context, primaryURL string, done <-chan struct{}) error {
	pc, err := connect(ctx, primaryURL)
	if err != nil {
		return fmt.Errorf("connect to --primary-url: %w", err)
	}
	defer pc.Close(context.WithoutCancel(ctx))
	t := time.NewTicker(500 * time.Millisecond)
	defer t.Stop()
	for {
		if _, err := pc.Exec(ctx, "SELECT pg_log_standby_snapshot()"); err != nil && ctx.Err() == nil {
			return fmt.Errorf("SELECT pg_log_standby_snapshot() on the primary: %w", err)
		}
		select {
		case <-done:
			return nil
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}

// standbySlotWait bounds the creation of the slot on a standby: the
// reconnect timeout (--postgres-timeout), at least 10 s.
func standbySlotWait(cfg Config) time.Duration {
	if cfg.Timeout < 10*time.Second {
		return 10 * time.Second
	}
	return cfg.Timeout
}

// recoveryGate holds back, on a session that decodes on a standby, each
// transaction past what the standby is known to have replayed, in
// recovery and on the session's timeline, until it has checked it still
// is: the walsender follows a promotion onto the new timeline, and a
// standby that follows another promoted standby onto its timeline, while
// the session labels its events with the timeline it started on
// (Event.Origin). Either ends the session before the first transaction it
// cannot label; the next session labels with the new timeline.
type recoveryGate struct {
	conn      *pgconn.PgConn // replication=database: SQL and IDENTIFY_SYSTEM
	timeline  int32          // the session's
	confirmed uint64         // replayed in recovery on timeline up to here
}

// openRecoveryGate connects to the standby for the gate's checks of a
// session on timeline.
func openRecoveryGate(ctx context.Context, connString string, timeline int32) (*recoveryGate, error) {
	cc, err := replicationConfig(connString)
	if err != nil {
		return nil, err
	}
	conn, err := pgconn.ConnectConfig(ctx, cc)
	if err != nil {
		return nil, fmt.Errorf("connect to the standby for its recovery state: %w", err)
	}
	return &recoveryGate{conn: conn, timeline: timeline}, nil
}

// pass returns nil when the transaction committed at lsn was replayed in
// recovery on the session's timeline, errPromoted when the server has been
// promoted, or moved to another timeline, since.
func (g *recoveryGate) pass(ctx context.Context, lsn uint64) error {
	if g == nil || lsn < g.confirmed {
		return nil
	}
	qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	// The replay position first, then the timeline: a timeline still the
	// session's after the position was read was the one replayed up to it.
	res, err := g.conn.Exec(qctx, "SELECT pg_is_in_recovery(), coalesce(pg_last_wal_replay_lsn(), '0/0')::text").ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 || len(res[0].Rows[0]) != 2 {
		return fmt.Errorf("read the standby's recovery state: %v", err)
	}
	if string(res[0].Rows[0][0]) != "t" {
		return errPromoted
	}
	r, err := pglogrepl.ParseLSN(string(res[0].Rows[0][1]))
	if err != nil {
		return fmt.Errorf("parse pg_last_wal_replay_lsn: %w", err)
	}
	sys, err := pglogrepl.IdentifySystem(qctx, g.conn)
	if err != nil {
		return fmt.Errorf("read the standby's timeline: %w", err)
	}
	if sys.Timeline != g.timeline {
		return errPromoted
	}
	g.confirmed = uint64(r) + 1
	return nil
}

func (g *recoveryGate) close() {
	if g != nil {
		_ = g.conn.Close(context.Background())
	}
}

// terminate ends backend pid (the role may end its own backends), best
// effort.
func terminate(ctx context.Context, connString string, pid int32) {
	tctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	c, err := connect(tctx, connString)
	if err != nil {
		return
	}
	defer c.Close(context.WithoutCancel(ctx))
	_, _ = c.Exec(tctx, "SELECT pg_terminate_backend($1, 5000)", pid)
}
