package replication

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jetbox-dev/jetbox/decoder"
)

// HeartbeatPrefix is the logical message prefix of jetbox's heartbeats.
const HeartbeatPrefix = decoder.HeartbeatPrefix

// SlotStats is what the monitor last read about the slot.
type SlotStats struct {
	At              time.Time
	ServerLSN       string // pg_current_wal_lsn()
	ConfirmedLSN    string // the slot's confirmed_flush_lsn
	LagBytes        int64  // server LSN - confirmed_flush_lsn
	RetainedBytes   int64  // server LSN - restart_lsn
	WALStatus       string // reserved, extended, unreserved, lost
	Active          bool
	OverThreshold   bool
	Err             string // the last monitoring error, if any
	HeartbeatsTotal uint64
	InRecovery      bool // the server is a standby
}

// monitor polls the slot over a normal SQL connection for metrics and the
// retained-WAL guardrail, and writes heartbeats when configured. It never
// changes the slot.
type monitor struct {
	s     *Streamer
	mu    sync.Mutex
	stats SlotStats
	warn  time.Time // last retained-WAL warning, for rate limiting
	// published: when the table was last seen in the publication.
	published time.Time
	// wasStandby: the last poll found the server in recovery (only run's
	// goroutine).
	wasStandby bool
	// primary is the connection to --primary-url for heartbeats while
	// the server is a standby (only run's goroutine).
	primary *pgx.Conn
}

func (m *monitor) snapshot() SlotStats {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.stats
}

func (m *monitor) run(ctx context.Context) {
	interval := m.s.cfg.MonitorInterval
	poll := time.NewTicker(interval)
	defer poll.Stop()
	var hb <-chan time.Time
	if m.s.cfg.HeartbeatInterval > 0 {
		t := time.NewTicker(m.s.cfg.HeartbeatInterval)
		defer t.Stop()
		hb = t.C
	}
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
		if m.primary != nil {
			m.primary.Close(context.Background())
		}
	}()
	ensure := func() bool {
		if conn != nil && !conn.IsClosed() {
			return true
		}
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		c, err := pgx.Connect(cctx, m.s.connString)
		if err != nil {
			m.fail(fmt.Errorf("monitor connect: %w", err))
			return false
		}
		conn = c
		return true
	}
	m.poll(ctx, ensure, &conn)
	for {
		select {
		case <-ctx.Done():
			return
		case <-poll.C:
			m.poll(ctx, ensure, &conn)
		case <-hb:
			if ensure() {
				m.heartbeat(ctx, conn)
			}
		}
	}
}

func (m *monitor) fail(err error) {
	m.mu.Lock()
	m.stats.Err = err.Error()
	m.mu.Unlock()
	m.s.log.Debug().Err(err).Msg("slot monitor")
}

func (m *monitor) poll(ctx context.Context, ensure func() bool, conn **pgx.Conn) {
	if !ensure() {
		return
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var st SlotStats
	err := (*conn).QueryRow(qctx, `SELECT
		CASE WHEN pg_is_in_recovery() THEN coalesce(pg_last_wal_receive_lsn(), '0/0') ELSE pg_current_wal_lsn() END::text AS server,
		coalesce(s.confirmed_flush_lsn::text, ''), coalesce(s.wal_status, ''), coalesce(s.active, false),
		coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn() ELSE pg_current_wal_lsn() END, s.confirmed_flush_lsn), 0)::bigint,
		coalesce(pg_wal_lsn_diff(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn() ELSE pg_current_wal_lsn() END, s.restart_lsn), 0)::bigint,
		pg_is_in_recovery()
		FROM (SELECT 1) one LEFT JOIN pg_replication_slots s ON s.slot_name = $1`, m.s.cfg.Slot).
		Scan(&st.ServerLSN, &st.ConfirmedLSN, &st.WALStatus, &st.Active, &st.LagBytes, &st.RetainedBytes, &st.InRecovery)
	if err != nil {
		(*conn).Close(context.Background())
		m.fail(fmt.Errorf("monitor query: %w", err))
		return
	}
	st.At = time.Now()
	m.notePromotion(st.InRecovery)
	mt := m.s.cfg.Metrics
	if lsn, err := pglogrepl.ParseLSN(st.ServerLSN); err == nil {
		mt.ServerLSN.Set(float64(lsn))
	}
	mt.LagBytes.Set(float64(st.LagBytes))
	mt.RetainedWAL.Set(float64(st.RetainedBytes))
	if max := m.s.cfg.MaxRetainedWAL; max > 0 && st.RetainedBytes > max {
		st.OverThreshold = true
		mt.RetainedOver.Set(1)
		if time.Since(m.warn) > time.Minute {
			m.warn = time.Now()
			m.s.log.Warn().Int64("retained_bytes", st.RetainedBytes).Int64("threshold_bytes", max).Str("wal_status", st.WALStatus).
				Msg("the slot retains more WAL than --max-retained-wal: jetbox is behind or blocked (is NATS reachable?); Postgres keeps this WAL until it is confirmed")
		}
	} else {
		mt.RetainedOver.Set(0)
	}
	m.mu.Lock()
	st.HeartbeatsTotal = m.stats.HeartbeatsTotal
	m.stats = st
	m.mu.Unlock()
	m.checkPublication(qctx, *conn)
}

// checkPublication stops jetbox when the outbox table is no longer
// published: Postgres then streams nothing for its rows (a dropped or
// altered publication, or the table dropped and recreated under a FOR TABLE
// publication), and carrying on would lose them silently.
func (m *monitor) checkPublication(ctx context.Context, conn *pgx.Conn) {
	cfg := m.s.cfg
	readAt := time.Now() // before the catalog reads: a change they miss committed after it
	var pubExists, published, inserts, tableExists, replaced bool
	var oid uint32
	start := m.s.startOID.Load()
	// A problem is read twice: one query can see a table replaced in one
	// transaction half old, half new (pg_publication_tables reads the
	// catalogs with a newer snapshot than the statement's), which looks
	// like a table left out of the publication.
	for attempt := 0; attempt < 2; attempt++ {
		err := conn.QueryRow(ctx, `SELECT
		EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
		EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3),
		coalesce((SELECT pubinsert FROM pg_publication WHERE pubname = $1), false),
		EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $2 AND tablename = $3),
		coalesce(to_regclass($4)::oid, 0)`,
			cfg.Publication, cfg.Decoder.Schema, cfg.Decoder.Table, cfg.quotedTable()).Scan(&pubExists, &published, &inserts, &tableExists, &oid)
		if err != nil {
			m.fail(fmt.Errorf("monitor publication query: %w", err))
			return
		}
		if !cfg.hasTable() { // --source=messages: only the publication must exist
			published, inserts, tableExists = true, true, true
		}
		replaced = start != 0 && oid != 0 && oid != start
		if pubExists && published && inserts {
			break // healthy, or replaced: no second look needed
		}
	}
	since := m.published
	if pubExists && published && inserts && !replaced {
		if m.checkMembership(ctx, conn, since) {
			m.published = readAt
		}
		return
	}
	if replaced && published && inserts {
		select {
		case m.s.fatal <- &PermanentError{Err: m.s.replacedError(start, oid, "while jetbox ran, after "+since.UTC().Format(time.RFC3339))}:
		default:
		}
		return
	}
	if pubExists && inserts && tableExists && !published && cfg.hasTable() {
		var leaves bool
		if err := conn.QueryRow(ctx, leavesPublishedSQL, cfg.Publication, cfg.quotedTable()).Scan(&leaves); err != nil {
			m.fail(fmt.Errorf("monitor publication query: %w", err))
			return
		}
		if leaves {
			select {
			case m.s.fatal <- m.s.viaRootError(since):
			default:
			}
			return
		}
	}
	create := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert')", quoteIdent(cfg.Publication), cfg.quotedTable())
	if !cfg.hasTable() {
		create = "CREATE PUBLICATION " + quoteIdent(cfg.Publication)
	}
	var what, fix string
	switch {
	case !pubExists:
		what, fix = fmt.Sprintf("publication %q was dropped while jetbox ran", cfg.Publication), create
	case !tableExists:
		what, fix = fmt.Sprintf("table %s was dropped while jetbox ran", cfg.qualifiedTable()), "recreate the table (see the README's DDL), then ALTER PUBLICATION "+quoteIdent(cfg.Publication)+" ADD TABLE "+cfg.quotedTable()
	case !published:
		what, fix = fmt.Sprintf("table %s is no longer in publication %q (removed, or dropped and recreated)", cfg.qualifiedTable(), cfg.Publication),
			"ALTER PUBLICATION "+quoteIdent(cfg.Publication)+" ADD TABLE "+cfg.quotedTable()
	default:
		what, fix = fmt.Sprintf("publication %q no longer publishes inserts", cfg.Publication), "ALTER PUBLICATION "+quoteIdent(cfg.Publication)+" SET (publish = 'insert')"
	}
	at := since.UTC().Format(time.RFC3339)
	err := &PermanentError{Err: fmt.Errorf("%s: Postgres does not stream outbox rows committed since then, and jetbox stops rather than lose them silently; fix: %s, then re-publish from the table the rows committed after %s: %s",
		what, fix, at, repairFix(cfg, at))}
	select {
	case m.s.fatal <- err:
	default:
	}
}

// viaRootError explains publish_via_partition_root turned off under a
// running jetbox (since: the last poll that saw the table published).
func (s *Streamer) viaRootError(since time.Time) error {
	cfg := s.cfg
	at := since.UTC().Format(time.RFC3339)
	return &PermanentError{
		Err: fmt.Errorf("publication %q no longer publishes the partitioned table %s through its root: publish_via_partition_root was turned off while jetbox ran, after %s. "+
			"pgoutput names its rows after the leaf partitions, which jetbox reads as outbox rows (in a publication of the outbox alone, even once a partition is dropped), but the ALTER PUBLICATION rewrote the publication, and jetbox cannot tell whether its publish setting changed too",
			cfg.Publication, cfg.qualifiedTable(), at),
		Hint: "fix: " + viaRootFix(cfg) + ", then restart jetbox: it goes on from the last row it confirmed. Should the start refuse the publication as altered after the slot's position: if only this option changed, start once with --accept-lost-rows; otherwise " + repairFix(cfg, at),
	}
}

// checkMembership stops jetbox when the outbox's membership in the
// publication loses rows the name check cannot see: a row filter, a column
// list leaving out a column jetbox reads, or the membership re-created
// since the first session read it (dropped and added back between two
// polls, a filter set and removed). It reports whether the membership is
// healthy. Rows committed after since, the last healthy poll, may be missing.
func (m *monitor) checkMembership(ctx context.Context, conn *pgx.Conn, since time.Time) bool {
	cfg := m.s.cfg
	if !cfg.hasTable() {
		return true
	}
	now, err := readMembership(ctx, conn.PgConn(), cfg)
	if err != nil {
		conn.Close(context.Background())
		m.fail(fmt.Errorf("monitor membership query: %w", err))
		return false
	}
	at := since.UTC().Format(time.RFC3339)
	var stop error
	if ps := now.problems(cfg); len(ps) > 0 {
		stop = &PermanentError{
			Err:  fmt.Errorf("%s; it was set while jetbox ran, after %s: %s", ps[0].What, at, ps[0].Loss),
			Hint: "fix: " + ps[0].Fix + ", then " + repairFix(cfg, at),
		}
	} else if first := m.s.member.Load(); first != nil && len(now.Rows) > 0 && !continuous(*first, now) {
		stop = m.s.changedError(*first, now, "while jetbox ran, after "+at, at)
	}
	if stop == nil {
		return true
	}
	select {
	case m.s.fatal <- stop:
	default:
	}
	return false
}

// heartbeat writes a non-transactional logical message: WAL in this
// database, so the slot has something to advance past even when only other
// databases of the cluster write. pgoutput does not forward it (messages are
// off) and jetbox never publishes it.
func (m *monitor) heartbeat(ctx context.Context, conn *pgx.Conn) {
	hctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var inRecovery bool
	if err := conn.QueryRow(hctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
		return
	}
	target := conn
	if inRecovery {
		// A standby cannot write WAL: the heartbeat goes to its primary
		// (--primary-url), whose WAL the standby decodes.
		if m.s.cfg.PrimaryURL == "" {
			return
		}
		if m.primary == nil || m.primary.IsClosed() {
			pc, err := pgx.Connect(hctx, m.s.cfg.PrimaryURL)
			if err != nil {
				m.fail(fmt.Errorf("heartbeat: connect to --primary-url: %w", err))
				return
			}
			m.primary = pc
		}
		target = m.primary
	}
	if _, err := target.Exec(hctx, "SELECT pg_logical_emit_message(false, $1, '')", HeartbeatPrefix); err != nil {
		target.Close(context.Background())
		m.fail(fmt.Errorf("heartbeat: %w", err))
		return
	}
	m.s.cfg.Metrics.Heartbeats.Inc()
	m.mu.Lock()
	m.stats.HeartbeatsTotal++
	m.mu.Unlock()
}

// errPromoted ends a session on a standby that was promoted: its logical
// walsender does not follow the new timeline, a new one does.
var errPromoted = errors.New("the standby jetbox decodes on was promoted: reconnecting, so that a new walsender decodes the new timeline (the slot is on this server already)")

// notePromotion asks the session to reconnect when the server, a standby
// at the last poll, is one no longer.
func (m *monitor) notePromotion(inRecovery bool) {
	if m.wasStandby && !inRecovery {
		m.s.log.Warn().Msg("the server was promoted: it is the primary now; reconnecting to decode its new timeline")
		select {
		case m.s.restart <- errPromoted:
		default:
		}
	}
	m.wasStandby = inRecovery
}
