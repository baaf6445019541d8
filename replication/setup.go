package replication

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/jetbox-dev/jetbox/internal/check"
	"github.com/rs/zerolog"
)

// ErrUnreachable wraps a failure to reach Postgres at all (as opposed to the
// server refusing us): worth retrying at start-up.
var ErrUnreachable = errors.New("postgres unreachable")

// Check inspects the Postgres side without changing anything and returns
// every finding at once: settings, role, table, publication and slot.
// Missing publication and slot are Create findings (Ensure makes them).
// The error is non-nil only when no check could run (cannot connect).
func Check(ctx context.Context, connString string, cfg Config, log zerolog.Logger) ([]check.Finding, error) {
	return checkWith(ctx, connString, cfg, log, defaultWALSearch)
}

// checkTimeout bounds the checks before the search of the WAL (see
// checker.membership), which has its own budget, and again those after it.
const checkTimeout = 30 * time.Second

func checkWith(ctx context.Context, connString string, cfg Config, log zerolog.Logger, search walSearch) ([]check.Finding, error) {
	cctx, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	conn, err := connect(cctx, connString)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var l check.List
	c := &checker{ctx: cctx, conn: conn, cfg: cfg, l: &l, parent: ctx, connString: connString, log: log, search: search}
	c.server()
	c.messages()
	tableOK := c.table()
	pubExists := c.publication(tableOK)
	c.slot(pubExists)
	c.membership(pubExists)
	// The search of the WAL in membership may have used a long budget of
	// its own: the checks after it get their own checkTimeout.
	rctx, cancelRest := context.WithTimeout(ctx, checkTimeout)
	defer cancelRest()
	c.ctx = rctx
	c.repairMarker()
	c.failover()
	c.standbySlots()
	c.orderIndex(tableOK)
	return l, nil
}

func connect(ctx context.Context, connString string, opts ...func(*pgx.ConnConfig)) (*pgx.Conn, error) {
	pcfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", err)
	}
	for _, o := range opts {
		o(pcfg)
	}
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) { // the server answered: a wrong password, no such database...
			return nil, fmt.Errorf("connect to postgres: %w", err)
		}
		return nil, fmt.Errorf("%w: %w", ErrUnreachable, err)
	}
	return conn, nil
}

type checker struct {
	ctx  context.Context // bounded by checkTimeout
	conn *pgx.Conn
	cfg  Config
	l    *check.List
	// The search of the WAL runs on its own connection, under parent and
	// its own budget.
	parent     context.Context
	connString string
	log        zerolog.Logger
	search     walSearch
	// facts gathered along the way
	superuser, replication, inRecovery bool
	walLogical, ownsTable              bool
	// publishGenerated: the publication jetbox creates must publish
	// generated columns (see tableColumns).
	publishGenerated bool
}

func (c *checker) fail(name string, err error) {
	c.l.Add(check.Error, name, "query failed: "+err.Error(), "check the role may read the system catalogs")
}

func (c *checker) server() {
	var version, walLevel, keep string
	var slotsUsed, slotsMax, sendersUsed, sendersMax int
	err := c.conn.QueryRow(c.ctx, `SELECT current_setting('server_version'), current_setting('wal_level'),
		current_setting('max_slot_wal_keep_size'), pg_is_in_recovery(),
		(SELECT count(*) FROM pg_replication_slots)::int, current_setting('max_replication_slots')::int,
		(SELECT count(*) FROM pg_stat_replication)::int, current_setting('max_wal_senders')::int,
		r.rolsuper, r.rolreplication
		FROM pg_roles r WHERE r.rolname = current_user`).
		Scan(&version, &walLevel, &keep, &c.inRecovery, &slotsUsed, &slotsMax, &sendersUsed, &sendersMax, &c.superuser, &c.replication)
	if err != nil {
		c.fail("postgres.server", err)
		return
	}
	c.l.Add(check.Info, "postgres.version", "PostgreSQL "+version, "")
	if c.inRecovery {
		c.standby()
	}
	c.walLogical = walLevel == "logical"
	if !c.walLogical {
		c.l.Add(check.Error, "postgres.wal_level", fmt.Sprintf("wal_level is %q", walLevel), "ALTER SYSTEM SET wal_level = logical; then restart Postgres")
	}
	if slotsUsed >= slotsMax {
		sev := check.Warning
		if !c.slotExists() {
			sev = check.Error
		}
		c.l.Add(sev, "postgres.max_replication_slots", fmt.Sprintf("all %d replication slots are in use", slotsMax),
			"raise max_replication_slots (restart needed) or drop an unused slot")
	} else {
		c.l.Add(check.Info, "postgres.max_replication_slots", fmt.Sprintf("%d of %d replication slots in use", slotsUsed, slotsMax), "")
	}
	if sendersUsed >= sendersMax {
		c.l.Add(check.Error, "postgres.max_wal_senders", fmt.Sprintf("all %d WAL senders are in use", sendersMax),
			"raise max_wal_senders (restart needed; budget 2 per slot for restarts) or stop another consumer")
	} else {
		c.l.Add(check.Info, "postgres.max_wal_senders", fmt.Sprintf("%d of %d WAL senders in use", sendersUsed, sendersMax), "")
	}
	if !c.superuser && !c.replication {
		c.l.Add(check.Error, "postgres.role", "the role has neither REPLICATION nor superuser", "ALTER ROLE "+pgx.Identifier{c.user()}.Sanitize()+" REPLICATION")
	}
	if keep == "-1" {
		c.l.Add(check.Info, "postgres.max_slot_wal_keep_size", "max_slot_wal_keep_size = -1: a slot is never invalidated, so a long jetbox outage retains WAL until the disk fills",
			"watch jetbox_slot_retained_wal_bytes, or set max_slot_wal_keep_size (then a long outage invalidates the slot: rows must be re-published from the table)")
	} else {
		c.l.Add(check.Info, "postgres.max_slot_wal_keep_size", "max_slot_wal_keep_size = "+keep+": the slot is invalidated if it retains more", "")
	}
}

func (c *checker) user() string {
	var u string
	_ = c.conn.QueryRow(c.ctx, "SELECT current_user").Scan(&u)
	return u
}

func (c *checker) slotExists() bool {
	var n int
	_ = c.conn.QueryRow(c.ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", c.cfg.Slot).Scan(&n)
	return n > 0
}

// hasTable reports whether the source includes the outbox table (not with
// --source=messages, whose decoder has no table).
func (c Config) hasTable() bool { return c.Decoder.Table != "" }

// messages checks what the messages source needs: PostgreSQL 14+ (the
// pgoutput messages option).
func (c *checker) messages() {
	if c.cfg.Decoder.MessagePrefix == "" {
		return
	}
	var num int
	if err := c.conn.QueryRow(c.ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
		c.fail("postgres.messages", err)
		return
	}
	if num < 140000 {
		c.l.Add(check.Error, "postgres.messages", fmt.Sprintf("the messages source needs PostgreSQL 14 or later (pgoutput's messages option); the server is %d", num/10000),
			"upgrade Postgres, or use --source=table")
		return
	}
	c.l.Add(check.Info, "postgres.messages", fmt.Sprintf("outbox messages: pg_logical_emit_message(true, %q, envelope) inside a transaction (see docs/routing.md)", c.cfg.Decoder.MessagePrefix), "")
}

func (c *checker) table() bool {
	if !c.cfg.hasTable() {
		var create bool
		if err := c.conn.QueryRow(c.ctx, "SELECT has_database_privilege(current_database(), 'CREATE')").Scan(&create); err != nil {
			c.fail("postgres.table", err)
			return false
		}
		c.ownsTable = create || c.superuser
		c.l.Add(check.Info, "postgres.table", "--source=messages: no outbox table (the publication needs none)", "")
		return true
	}
	name := c.cfg.qualifiedTable()
	var persistence, kind string
	var owner bool
	err := c.conn.QueryRow(c.ctx, `SELECT c.relpersistence::text, c.relkind::text, pg_has_role(c.relowner, 'USAGE')
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2`,
		c.cfg.Decoder.Schema, c.cfg.Decoder.Table).Scan(&persistence, &kind, &owner)
	if errors.Is(err, pgx.ErrNoRows) {
		c.l.Add(check.Error, "postgres.table", fmt.Sprintf("table %s does not exist", name),
			"create it (see the outbox DDL in the README) or set --table to the outbox table")
		return false
	}
	if err != nil {
		c.fail("postgres.table", err)
		return false
	}
	if kind != "r" && kind != "p" {
		c.l.Add(check.Error, "postgres.table", fmt.Sprintf("%s is not a table (relkind %q)", name, kind), "point --table at the outbox table")
		return false
	}
	ok := true
	if persistence != "p" {
		c.l.Add(check.Error, "postgres.table", fmt.Sprintf("table %s is unlogged or temporary: its rows never reach the WAL", name), "ALTER TABLE "+c.cfg.quotedTable()+" SET LOGGED")
		ok = false
	}
	tc, err := readColumns(c.ctx, c.conn.PgConn(), c.cfg)
	if err != nil {
		c.fail("postgres.table", err)
		return false
	}
	c.publishGenerated = tc.publishGenerated
	for _, p := range tc.problems {
		c.l.Add(check.Error, "postgres.table", "table "+name+": "+p.msg, p.fix)
		ok = false
	}
	_, problems := decoder.CheckColumns(c.cfg.Decoder.Columns, tc.cols)
	for _, p := range problems {
		c.l.Add(check.Error, "postgres.table", "table "+name+": "+p, "alter the table to match the outbox DDL in the README, or set the --*-column flags to its column names")
		ok = false
	}
	if ok {
		c.l.Add(check.Info, "postgres.table", "table "+name+" fits the outbox contract", "")
	}
	c.ownsTable = owner || c.superuser
	return ok
}

func (c *checker) publicationSQL() string {
	if !c.cfg.hasTable() {
		return fmt.Sprintf("CREATE PUBLICATION %s", pgx.Identifier{c.cfg.Publication}.Sanitize())
	}
	gen := ""
	if c.publishGenerated {
		gen = ", publish_generated_columns = stored" // PostgreSQL 18+
	}
	return fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert', publish_via_partition_root = true%s)",
		pgx.Identifier{c.cfg.Publication}.Sanitize(), c.cfg.quotedTable(), gen)
}

// publication reports whether the publication exists.
func (c *checker) publication(tableOK bool) bool {
	pub := pgx.Identifier{c.cfg.Publication}.Sanitize()
	var insert bool
	err := c.conn.QueryRow(c.ctx, "SELECT pubinsert FROM pg_publication WHERE pubname = $1", c.cfg.Publication).Scan(&insert)
	if errors.Is(err, pgx.ErrNoRows) {
		switch {
		case !tableOK:
		case c.inRecovery && c.cfg.PrimaryURL == "":
			c.l.Add(check.Error, "postgres.publication", fmt.Sprintf("publication %q is missing, and the server is a standby, which cannot create it", c.cfg.Publication),
				"run on the primary: "+c.publicationSQL()+" (or set --primary-url: jetbox run then creates it there)")
		case c.inRecovery:
			c.l.Add(check.Create, "postgres.publication", fmt.Sprintf("publication %q is missing: jetbox run creates it on the primary (--primary-url): %s", c.cfg.Publication, c.publicationSQL()), "")
		case c.ownsTable:
			c.l.Add(check.Create, "postgres.publication", fmt.Sprintf("publication %q is missing: jetbox run creates it (%s)", c.cfg.Publication, c.publicationSQL()), "")
		default:
			c.l.Add(check.Error, "postgres.publication", fmt.Sprintf("publication %q is missing and this role cannot create it (it does not own the table, or, with no table, may not create in the database)", c.cfg.Publication),
				"run as an administrator: "+c.publicationSQL())
		}
		return false
	}
	if err != nil {
		c.fail("postgres.publication", err)
		return false
	}
	if !insert && c.cfg.hasTable() {
		c.l.Add(check.Error, "postgres.publication", fmt.Sprintf("publication %q does not publish inserts", c.cfg.Publication),
			fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert')", pub))
	}
	if !c.cfg.hasTable() {
		c.l.Add(check.Info, "postgres.publication", fmt.Sprintf("publication %q exists (messages need no table in it)", c.cfg.Publication), "")
		return true
	}
	var n int
	if err := c.conn.QueryRow(c.ctx, "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
		c.cfg.Publication, c.cfg.Decoder.Schema, c.cfg.Decoder.Table).Scan(&n); err != nil {
		c.fail("postgres.publication", err)
		return true
	}
	// A partitioned outbox in a publication without
	// publish_via_partition_root is a member, yet pg_publication_tables
	// lists its leaf partitions instead: rows would be named after them
	// (ADD TABLE is refused, the table already is a member).
	var leaves bool
	if n == 0 {
		if err := c.conn.QueryRow(c.ctx, leavesPublishedSQL, c.cfg.Publication, c.cfg.quotedTable()).Scan(&leaves); err != nil {
			c.fail("postgres.publication", err)
			return true
		}
	}
	switch {
	case leaves:
		c.l.Add(check.Error, "postgres.publication", fmt.Sprintf("publication %q publishes the partitioned table %s without publish_via_partition_root: its rows would arrive named after the leaf partitions, not the outbox", c.cfg.Publication, c.cfg.qualifiedTable()),
			viaRootFix(c.cfg))
	case n == 0:
		c.l.Add(check.Error, "postgres.publication", fmt.Sprintf("publication %q does not contain %s", c.cfg.Publication, c.cfg.qualifiedTable()),
			fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s", pub, c.cfg.quotedTable()))
	case insert:
		c.l.Add(check.Info, "postgres.publication", fmt.Sprintf("publication %q publishes inserts of %s", c.cfg.Publication, c.cfg.qualifiedTable()), "")
	}
	return true
}

func (c *checker) slot(pubExists bool) {
	var (
		plugin, slotType, walStatus, db, current, confirmed, invalid string
		twoPhase, active                                             bool
		retained                                                     int64
		pid                                                          *int32
	)
	err := c.conn.QueryRow(c.ctx, `SELECT coalesce(plugin, ''), slot_type, coalesce(database, ''), current_database(),
		coalesce(wal_status, ''), two_phase, coalesce(confirmed_flush_lsn::text, '0/0'), active, active_pid,
		coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn() ELSE pg_current_wal_lsn() END, restart_lsn), 0)::bigint,
		`+invalidationSQL+`
		FROM pg_replication_slots s WHERE slot_name = $1`, c.cfg.Slot).
		Scan(&plugin, &slotType, &db, &current, &walStatus, &twoPhase, &confirmed, &active, &pid, &retained, &invalid)
	drop := fmt.Sprintf("SELECT pg_drop_replication_slot('%s') (rows not yet forwarded are then lost: re-publish them from the table) or set --slot to another name", c.cfg.Slot)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		if c.walLogical && (c.superuser || c.replication) {
			c.l.Add(check.Create, "postgres.slot", fmt.Sprintf("replication slot %q is missing: jetbox run creates it (pgoutput, permanent); outbox rows committed before that are not streamed", c.cfg.Slot), "")
		}
		return
	case err != nil:
		c.fail("postgres.slot", err)
		return
	}
	switch {
	case slotType != "logical" || plugin != "pgoutput":
		c.l.Add(check.Error, "postgres.slot", fmt.Sprintf("slot %q is a %s slot with plugin %q, not a logical pgoutput slot", c.cfg.Slot, slotType, plugin), drop)
	case db != current:
		c.l.Add(check.Error, "postgres.slot", fmt.Sprintf("slot %q belongs to database %q, not %q", c.cfg.Slot, db, current), "connect to database "+db+" or set --slot to another name")
	case invalid != "" && c.cfg.AutoRepair:
		c.l.Add(check.Warning, "postgres.slot", fmt.Sprintf("slot %q %s, so the outbox rows committed since its confirmed LSN %s can no longer be streamed: jetbox run --on-lost-slot=repair repairs it (jetbox repair's steps) before it streams", c.cfg.Slot, describeInvalidation(invalid), confirmed), "")
	case invalid != "":
		c.l.Add(check.Error, "postgres.slot", fmt.Sprintf("slot %q %s, so the outbox rows committed since its confirmed LSN %s can no longer be streamed", c.cfg.Slot, describeInvalidation(invalid), confirmed),
			"run `jetbox repair` with the same configuration, or follow the runbook \"slot invalidated\" in docs/operations.md: re-publish the rows committed since then from the table (same ids: dedup absorbs overlaps), then "+drop+" and restart jetbox")
	case twoPhase:
		c.l.Add(check.Error, "postgres.slot", fmt.Sprintf("slot %q has two_phase enabled: prepared transactions would be published before they commit", c.cfg.Slot), drop)
	default:
		holder := ""
		if active && pid != nil {
			holder = fmt.Sprintf(", held by walsender pid %d (another jetbox?)", *pid)
		}
		sev := check.Info
		if c.cfg.MaxRetainedWAL > 0 && retained > c.cfg.MaxRetainedWAL {
			sev = check.Warning
		}
		c.l.Add(sev, "postgres.slot", fmt.Sprintf("slot %q: pgoutput, confirmed to %s, retains %d bytes of WAL, wal_status %s%s", c.cfg.Slot, confirmed, retained, walStatus, holder), "")
	}
	if !pubExists {
		c.l.Add(check.Warning, "postgres.publication", "the slot exists but the publication does not: rows committed between the two may be lost (Postgres 18 skips them silently)",
			"create the publication, then compare the stream with the table for rows committed before it")
	}
}

// membership checks what a check by name cannot see: a row filter or a
// column list on the outbox (PostgreSQL 15+), and a membership newer than
// the slot's position (the table dropped from the publication and added
// back while jetbox was stopped): see readMembership.
func (c *checker) membership(pubExists bool) {
	if !pubExists || !c.cfg.hasTable() {
		return
	}
	m, err := readMembership(c.ctx, c.conn.PgConn(), c.cfg)
	if err != nil {
		c.fail("postgres.publication", err)
		return
	}
	for _, p := range m.problems(c.cfg) {
		fix := p.Fix
		if m.SlotKnown {
			fix += "; if jetbox streamed under it, rows may be missing from the stream: " + repairFix(c.cfg, "")
		}
		c.l.Add(check.Error, "postgres.publication", p.What, fix)
	}
	if m.predatesSlot() {
		return
	}
	// The catalog_xmin lags (it moves only as the slot is confirmed past
	// running-transactions records; a new slot starts at the oldest of the
	// other slots'): look in the WAL for the transactions themselves.
	// seen: every commit the catalog read saw is in the WAL before it (on
	// a standby, received).
	var confirmed string
	var seen pglogrepl.LSN
	if err := c.conn.QueryRow(c.ctx, `SELECT coalesce((SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1), '0/0'),
		CASE WHEN pg_is_in_recovery() THEN greatest(coalesce(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn()), pg_last_wal_replay_lsn()) ELSE pg_current_wal_insert_lsn() END::text`, c.cfg.Slot).Scan(&confirmed, &seen); err != nil {
		c.fail("postgres.publication", err)
		return
	}
	pl, rep, err := c.searchWAL(m.suspects(), seen)
	var how string
	switch {
	case err != nil:
		how = "are not older than the slot's catalog_xmin, and the WAL around the slot's position could not be searched for them (" + err.Error() + "), so they may be newer"
	default:
		c.l.Add(check.Info, "postgres.publication", fmt.Sprintf("the catalog rows behind the membership of %s in publication %q (%s) are not older than slot %q's catalog_xmin: searched the WAL around the slot's position for their transactions, %s", c.cfg.qualifiedTable(), c.cfg.Publication, m.describe(), c.cfg.Slot, rep), "")
		if m = m.settle(pl.Before); m.predatesSlot() {
			return
		}
		how = "committed after the slot's position (found in the WAL from there)"
		if len(pl.After) == 0 {
			how = "were not seen committing after the slot's position, but a transaction with an older xid committed after it: they may have been written inside a subtransaction (SAVEPOINT, a PL/pgSQL EXCEPTION block) of that transaction, whose xid is the only one the WAL's commit names, so they may be newer"
		}
	}
	what, fix := newerError(c.cfg, m, confirmed, how)
	sev := check.Error
	if c.cfg.AcceptLostRows {
		sev, what = check.Warning, "--accept-lost-rows: going on; "+what
	}
	c.l.Add(sev, "postgres.publication", what, fix)
}

// searchWAL runs placeSuspects on a connection of its own (a search that
// runs out of time loses its connection, not the checker's), logging it:
// the start waits for it. A context done mid-call sends the server a
// cancel request, so it does not decode on for nothing.
func (c *checker) searchWAL(xids []string, seen pglogrepl.LSN) (placement, searchReport, error) {
	conn, err := connect(c.ctx, c.connString, func(pcfg *pgx.ConnConfig) {
		pcfg.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: pc, DeadlineDelay: 5 * time.Second}
		}
	})
	if err != nil {
		return placement{}, searchReport{}, err
	}
	defer conn.Close(context.WithoutCancel(c.ctx))
	c.log.Info().Str("slot", c.cfg.Slot).Strs("xids", xids).
		Msg("searching the WAL around the slot's position for the transactions behind the outbox's membership in the publication (their xids are not older than the slot's catalog_xmin): the start waits for it")
	pl, rep, err := placeSuspects(c.parent, conn, c.cfg.Slot, xids, seen, c.search)
	ev := c.log.Info()
	if err != nil {
		ev = c.log.Warn().Err(err)
	}
	ev.Str("slot", c.cfg.Slot).Int64("wal_bytes", rep.Bytes).Int64("searched_bytes", rep.Searched).Dur("took", rep.Took).Bool("early", rep.Early).
		Msg("searched the WAL around the slot's position")
	return pl, rep, err
}

// Ensure creates what Check reported missing: the publication, then the
// slot (in that order: the slot must not predate the publication).
func Ensure(ctx context.Context, connString string, cfg Config, log zerolog.Logger) error {
	conn, err := connect(ctx, connString)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_publication WHERE pubname = $1", cfg.Publication).Scan(&n); err != nil {
		return fmt.Errorf("look up publication %q: %w", cfg.Publication, err)
	}
	var inRecovery bool
	if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		return fmt.Errorf("read pg_is_in_recovery: %w", err)
	}
	if n == 0 && inRecovery {
		if err := ensurePublicationOnPrimary(ctx, conn, cfg, log); err != nil {
			return err
		}
	} else if n == 0 {
		if err := createPublication(ctx, conn, cfg); err != nil {
			return err
		}
		ev := log.Info().Str("publication", cfg.Publication)
		if cfg.hasTable() {
			ev = ev.Str("table", cfg.qualifiedTable())
		}
		ev.Msg("created publication")
	}
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1", cfg.Slot).Scan(&n); err != nil {
		return fmt.Errorf("look up slot %q: %w", cfg.Slot, err)
	}
	if n == 0 {
		var lsn string
		var num int
		if err := conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num); err != nil {
			return fmt.Errorf("read server version: %w", err)
		}
		create := "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false)"
		failover := num >= 170000 && !inRecovery
		if failover {
			// A failover slot: standbys with sync_replication_slots keep a
			// copy, so the slot survives a promotion (see docs/operations.md).
			create = "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
		}
		var err error
		started := time.Now()
		if inRecovery {
			lsn, err = createSlotOnStandby(ctx, conn, cfg, standbySlotWait(cfg))
		} else {
			err = conn.QueryRow(ctx, create, cfg.Slot).Scan(&lsn)
		}
		if isDuplicate(err) {
			return nil // another instance created it just now
		}
		if err != nil {
			return fmt.Errorf("create replication slot %q: %w", cfg.Slot, err)
		}
		log.Warn().Str("slot", cfg.Slot).Str("lsn", lsn).Bool("failover", failover).Bool("standby", inRecovery).Dur("took", time.Since(started)).
			Msg("created replication slot: outbox rows committed before this LSN are not streamed")
	}
	return nil
}

// createPublication creates the publication Check describes (publishing
// generated columns when an outbox column is one, on PostgreSQL 18+). A
// publication another instance created meanwhile is no error.
func createPublication(ctx context.Context, conn *pgx.Conn, cfg Config) error {
	c := &checker{cfg: cfg}
	if cfg.hasTable() {
		tc, err := readColumns(ctx, conn.PgConn(), cfg)
		if err != nil {
			return err
		}
		c.publishGenerated = tc.publishGenerated
	}
	if _, err := conn.Exec(ctx, c.publicationSQL()); err != nil && !isDuplicate(err) { // another instance won the race
		return fmt.Errorf("create publication %q: %w", cfg.Publication, err)
	}
	return nil
}

// isDuplicate reports that another session created the object first:
// SQLSTATE 42710 duplicate_object, or 23505 unique_violation when the two
// creations raced inside the catalog (seen on PostgreSQL 18).
func isDuplicate(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "42710" || pgErr.Code == "23505")
}

// orderIndex warns when the outbox's created-at column, by which jetbox
// repair and jetbox audit read the table page by page, leads no index:
// every page then scans the table, and an audit's cost grows with the
// square of the range.
func (c *checker) orderIndex(tableOK bool) {
	col := c.cfg.CreatedAtColumn
	if !tableOK || col == "" || !c.cfg.hasTable() {
		return
	}
	var hasCol, indexed bool
	err := c.conn.QueryRow(c.ctx, `SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2 AND attnum > 0 AND NOT attisdropped),
		EXISTS (SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0] WHERE i.indrelid = to_regclass($1) AND a.attname = $2)`,
		c.cfg.quotedTable(), col).Scan(&hasCol, &indexed)
	switch {
	case err != nil:
		c.fail("postgres.order_index", err)
	case hasCol && !indexed:
		c.l.Add(check.Warning, "postgres.order_index", fmt.Sprintf("no index of %s leads with %s: jetbox audit and jetbox repair read the table page by page on it, and each page then scans the whole table", c.cfg.qualifiedTable(), col),
			fmt.Sprintf("CREATE INDEX CONCURRENTLY ON %s (%s, %s)", c.cfg.quotedTable(), pgx.Identifier{col}.Sanitize(), pgx.Identifier{c.cfg.Decoder.Columns.ID}.Sanitize()))
	}
}
