package replication

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/internal/wait"
)

// membership is how the outbox table belongs to the publication, as the
// catalog says now. Postgres filters what it streams by the publication as
// it was when each transaction committed, so a change the catalog no longer
// shows (the table dropped from the publication and added back, a row
// filter set and removed) has lost rows by the time it is read. What jetbox
// can see is the identity of the rows that make the table a member: each
// change creates a new one.
type membership struct {
	// Rows are the catalog rows that put the table in the publication:
	// its pg_publication_rel row ("table"), a pg_publication_namespace row
	// of its schema ("schema", PG15+), or the publication itself for FOR
	// ALL TABLES ("all-tables"). None: the table is not a member, or is one
	// only through a partitioned ancestor (not tracked).
	Rows []memberRow
	// PubXmin is the publication row's xmin: an ALTER PUBLICATION that
	// changes it (publish, owner) may have stopped inserts for a while.
	PubXmin string
	// PubNewer: the publication's own row was written (created, or altered:
	// publish, owner, name) at or after the slot's catalog_xmin.
	PubNewer bool
	// SlotKnown: the slot exists with a catalog_xmin to compare with.
	SlotKnown bool

	// PG15+ only (PG14 has neither).
	RowFilter string   // pg_publication_tables.rowfilter, "" if none
	Left      []string // columns jetbox reads that the column list leaves out
}

// memberRow is one catalog row behind the membership.
type memberRow struct {
	Kind string // table, schema, all-tables
	OID  uint32
	Xmin string // the transaction that created it
	// Newer: its xmin is not older than the slot's catalog_xmin, so the row
	// may have been created after the slot's confirmed position.
	Newer bool
}

// ids returns the rows' identities, sorted.
func (m membership) ids() []string {
	var out []string
	for _, r := range m.Rows {
		out = append(out, r.Kind+":"+strconv.FormatUint(uint64(r.OID), 10))
	}
	slices.Sort(out)
	return out
}

// describe names the rows for an error message.
func (m membership) describe() string {
	return strings.Join(append(m.ids(), "publication row xmin "+m.PubXmin), ", ")
}

// continuous reports whether the membership now shares a catalog row with
// the membership then: a row that still exists has existed throughout, so
// the table was a member throughout (a row is never re-created with the same
// OID), provided the publication's own row was not rewritten either (its
// publish setting may have changed and back). Both empty is not continuity:
// nothing was tracked.
func continuous(then, now membership) bool {
	if then.PubXmin != now.PubXmin {
		return false
	}
	for _, a := range then.ids() {
		if slices.Contains(now.ids(), a) {
			return true
		}
	}
	return false
}

// predatesSlot reports whether every row of the membership (and the
// publication's own row) was written before the slot's catalog_xmin. That
// xid is the oldest transaction still running at a point the slot was
// confirmed past, so a row whose xmin is older committed before that
// point: the table has been a member, unchanged, since then, and every row
// committed after the slot's confirmed position is streamed. Otherwise the
// membership may be newer than that position; rows committed between the
// position and its creation would then never be streamed. It cannot tell
// which: false is "may be", not "is".
func (m membership) predatesSlot() bool {
	if !m.SlotKnown || len(m.Rows) == 0 {
		return true // nothing to compare: no slot (streams from now on), or not tracked
	}
	if m.PubNewer {
		return false
	}
	for _, r := range m.Rows {
		if !r.Newer {
			return true // one row older than the slot's position suffices
		}
	}
	return false
}

// suspects returns the xids of the rows predatesSlot could not place
// before the slot's position: the transactions to look for after it.
func (m membership) suspects() []string {
	var out []string
	if m.PubNewer {
		out = append(out, m.PubXmin)
	}
	for _, r := range m.Rows {
		if r.Newer && !slices.Contains(out, r.Xmin) {
			out = append(out, r.Xmin)
		}
	}
	return out
}

// settle decides what predatesSlot left open, given which of the suspects
// a search placed before the slot's confirmed position (see
// placeSuspects): every other suspect may be newer.
func (m membership) settle(before map[string]bool) membership {
	m.PubNewer = m.PubNewer && !before[m.PubXmin]
	m.Rows = slices.Clone(m.Rows)
	for i := range m.Rows {
		m.Rows[i].Newer = m.Rows[i].Newer && !before[m.Rows[i].Xmin]
	}
	return m
}

// walSearch bounds a search of the WAL around a slot's confirmed position
// (see placeSuspects).
type walSearch struct {
	// Chunk is how far past the position the first call after it decodes;
	// each next one goes twice as far, up to maxChunk. Every call reads
	// again from the copy's restart point, which moves only at
	// running-transactions records, so a fixed step would read a long
	// backlog over and over; doubling reads it about twice at most.
	Chunk int64
	// Budget is how long a call that decodes n bytes of WAL (from the
	// copy's restart point) may take.
	Budget func(n int64) time.Duration
}

// defaultWALSearch decodes 16 MiB at first and allows a call a minute
// plus a second per 4 MiB it decodes: test_decoding decodes tens of MiB a
// second on a small server (see docs/failure-modes.md), so only a server
// that is far slower than that, or stuck, runs out.
var defaultWALSearch = walSearch{
	Chunk:  16 << 20,
	Budget: func(n int64) time.Duration { return time.Minute + time.Duration(n/(4<<20))*time.Second },
}

// maxChunk bounds a call of the search: pg_logical_slot_get_changes
// holds its whole output on the server.
const maxChunk = 256 << 20

// shadowedSearch is how far past the slot's position a search goes on for
// xids that are all shadowed (see placeSuspects).
const shadowedSearch = 1 << 30

// searchReport says how much of the WAL a search decoded.
type searchReport struct {
	Bytes    int64 // WAL from the slot's confirmed position to the end when the search began
	Searched int64 // how much of it was decoded
	Took     time.Duration
	Early    bool // every suspect was placed before the end
}

func (r searchReport) String() string {
	mib := func(n int64) string { return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB" }
	return fmt.Sprintf("%s of %s in %s", mib(r.Searched), mib(r.Bytes), r.Took.Round(time.Millisecond))
}

// placement is where a search put the suspects: before the slot's
// confirmed position, after it, or neither (see placeSuspects).
type placement struct {
	Before map[string]bool // committed before the position
	After  map[string]bool // committed after it: the COMMIT was decoded there
	// Shadowed: a transaction with an older xid committed after the
	// position, which may have been its top transaction.
	Shadowed map[string]bool
}

// placeSuspects places each xid before or after the slot's confirmed
// position S. pgoutput sends nothing for a transaction that only changed
// the catalog, so it decodes the WAL with a temporary copy of the slot
// under test_decoding, which shows every transaction (its COMMIT line
// carries the xid). It decodes in chunks that consume the copy, the first
// up to S (it outputs at most the commit of a record that straddles S, and
// moves the copy's catalog_xmin over the running-transactions records
// before S), the next ones past it, until every xid is placed or the end is
// reached: the flushed WAL (on a standby, the replayed WAL) once it has
// passed seen, a position read after the caller's catalog read (the insert
// position; on a standby, the received one), so it holds every commit that
// read could have seen.
//
// After: its COMMIT was decoded after S.
//
// Shadowed: a COMMIT decoded after S has an older xid. test_decoding names
// only a transaction's top xid, so the xid may be a subtransaction's
// (SAVEPOINT), and that commit its top transaction's (Postgres assigns a
// parent's xid before its children's): it may be newer than S.
//
// Before, neither found nor shadowed, and: older than the copy's
// catalog_xmin once it has decoded up to P (it had finished before a
// running-transactions record before P; Postgres writes one at every
// checkpoint and every 15 s while busy), or the end reached. Its
// transaction, top or not, did not commit after S: it committed before.
//
// Every xid ends in one map, unless an error is returned.
func placeSuspects(ctx context.Context, conn *pgx.Conn, slot string, xids []string, seen pglogrepl.LSN, lim walSearch) (pl placement, rep searchReport, _ error) {
	started := time.Now()
	defer func() { rep.Took = time.Since(started) }()
	pctx, cancel := context.WithTimeout(ctx, checkTimeout) // set-up
	defer cancel()
	probe := fmt.Sprintf("jetbox_probe_%d", conn.PgConn().PID())
	if _, err := conn.Exec(pctx, "SELECT pg_copy_logical_replication_slot($1, $2, true, 'test_decoding')", slot, probe); err != nil {
		return pl, rep, fmt.Errorf("copy slot %q to a temporary test_decoding slot %q: %w", slot, probe, err)
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = conn.Exec(dctx, "RESET statement_timeout")
		_, _ = conn.Exec(dctx, "SELECT pg_drop_replication_slot($1)", probe)
	}()
	// Decoding reads the flushed WAL (on a standby, the replayed WAL). An
	// asynchronous commit the catalog read saw may not be flushed yet, a
	// commit replayed on a standby is visible before its end is counted as
	// replayed: wait until the end passes seen.
	const endSQL = "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_flush_lsn() END"
	for {
		var reached bool
		if err := conn.QueryRow(pctx, "SELECT "+endSQL+" >= $1::pg_lsn", seen.String()).Scan(&reached); err != nil {
			return pl, rep, fmt.Errorf("wait for the WAL to be flushed or replayed up to %s: %w", seen, err)
		}
		if reached {
			break
		}
		if err := wait.Sleep(pctx, 20*time.Millisecond); err != nil {
			return pl, rep, fmt.Errorf("wait for the WAL to be flushed or replayed up to %s: %w", seen, err)
		}
	}
	var start, back, last pglogrepl.LSN // S, the copy's restart point, the end
	err := conn.QueryRow(pctx, `SELECT s.confirmed_flush_lsn::text, s.restart_lsn::text, e.lsn::text, greatest(pg_wal_lsn_diff(e.lsn, s.confirmed_flush_lsn), 0)::bigint
		FROM pg_replication_slots s, (SELECT `+endSQL+` AS lsn) e
		WHERE s.slot_name = $1`, probe).Scan(&start, &back, &last, &rep.Bytes)
	if err != nil {
		return pl, rep, fmt.Errorf("read slot %q's confirmed position and the WAL's end: %w", probe, err)
	}
	// fail says how far the search got and what the call was allowed.
	var budget time.Duration
	fail := func(err error) error {
		rep.Took = time.Since(started)
		return fmt.Errorf("decode slot %q's WAL around its confirmed position %s (searched %s, the call's budget %s): %w", slot, start, rep, budget, err)
	}
	pl = placement{Before: map[string]bool{}, After: map[string]bool{}, Shadowed: map[string]bool{}}
	open := slices.Clone(xids)
	// The first call decodes up to S (chunk 0), the next ones past it. A
	// shadowed xid is refused in any case: it is looked for only in the
	// first shadowedSearch past S, for the refusal to say whether it was
	// found.
	for pos, chunk, first := start, int64(0), true; len(open) > 0 && (first || pos < last); first, chunk = false, min(max(lim.Chunk, 2*chunk), maxChunk) {
		if !slices.ContainsFunc(open, func(x string) bool { return !pl.Shadowed[x] }) && int64(pos-start) >= shadowedSearch {
			break
		}
		upto := min(pos+pglogrepl.LSN(chunk), last)
		if first {
			upto = start
		}
		// Each call decodes from the copy's restart point, which an old
		// open transaction may hold back: its budget is for what it reads.
		// The server stops too when it runs out (pgx would only close the
		// socket, which the server does not notice while it decodes).
		budget = lim.Budget(int64(max(upto, back) - back))
		cctx, cancel := context.WithTimeout(ctx, budget)
		if _, err := conn.Exec(cctx, fmt.Sprintf("SET statement_timeout = %d", max(budget.Milliseconds(), 1))); err != nil {
			cancel()
			return pl, rep, fail(fmt.Errorf("set the search's statement_timeout: %w", err))
		}
		// The suspects committed in the chunk, and those a commit in it
		// with an older xid may have been the top transaction of.
		var found, behind []string
		err := conn.QueryRow(cctx, `WITH c AS MATERIALIZED (
				SELECT substr(data, 8)::xid AS x FROM pg_logical_slot_get_changes($1, $2::pg_lsn, NULL, 'include-xids', '1', 'skip-empty-xacts', '0')
				WHERE data ~ '^COMMIT [0-9]+$'),
			m AS (SELECT max(age(x)) AS oldest FROM c)
			SELECT coalesce((SELECT array_agg(DISTINCT x::text) FROM c WHERE x::text = ANY ($3)), '{}'),
				coalesce((SELECT array_agg(o) FROM unnest($3::text[]) o, m WHERE m.oldest > age(o::xid)), '{}')`,
			probe, upto.String(), open).Scan(&found, &behind)
		if err != nil {
			cancel()
			return pl, rep, fail(err)
		}
		for _, x := range found {
			pl.After[x] = true
		}
		for _, x := range behind {
			pl.Shadowed[x] = true
		}
		var next pglogrepl.LSN
		var older []string
		err = conn.QueryRow(cctx, `SELECT s.confirmed_flush_lsn::text, s.restart_lsn::text,
			coalesce((SELECT array_agg(x) FROM unnest($2::text[]) x WHERE age(x::xid) > age(s.catalog_xmin)), '{}')
			FROM pg_replication_slots s WHERE s.slot_name = $1`, probe, open).Scan(&next, &back, &older)
		cancel()
		if err != nil {
			return pl, rep, fail(fmt.Errorf("read slot %q's position: %w", probe, err))
		}
		for _, x := range older {
			if !pl.After[x] && !pl.Shadowed[x] {
				pl.Before[x] = true
			}
		}
		if !first && next <= pos {
			return pl, rep, fail(fmt.Errorf("the copy stayed at %s, short of the end %s", next, last))
		}
		pos = max(pos, next)
		rep.Searched = min(int64(pos-start), rep.Bytes)
		// A shadowed xid is still looked for: found, the refusal can say
		// it committed after S.
		open = slices.DeleteFunc(open, func(x string) bool { return pl.After[x] || pl.Before[x] })
		rep.Early = len(open) == 0 && pos < last
	}
	for _, x := range open { // the end, or only shadowed xids left
		if !pl.Shadowed[x] {
			pl.Before[x] = true
		}
	}
	return pl, rep, nil
}

// memberProblem is a publication setting under which Postgres streams some
// outbox rows or headers not at all.
type memberProblem struct {
	What, Fix string
	Loss      string // what a stream written under it misses
}

// problems returns what in the membership loses rows or data silently: a
// row filter, a column list leaving out a column jetbox reads.
func (m membership) problems(cfg Config) []memberProblem {
	pub, table := quoteIdent(cfg.Publication), cfg.quotedTable()
	republish := fmt.Sprintf("BEGIN; ALTER PUBLICATION %s DROP TABLE %s; ALTER PUBLICATION %s ADD TABLE %s; COMMIT", pub, table, pub, table)
	var out []memberProblem
	if m.RowFilter != "" {
		out = append(out, memberProblem{
			What: fmt.Sprintf("publication %q publishes %s with a row filter (WHERE %s): Postgres never streams the rows it filters out, and jetbox would confirm the slot past them",
				cfg.Publication, cfg.qualifiedTable(), m.RowFilter),
			Fix:  "publish every row: " + republish,
			Loss: "the outbox rows it filtered out since then may be missing from the stream",
		})
	}
	if len(m.Left) > 0 {
		cols := make([]string, len(m.Left))
		for i, c := range m.Left {
			cols[i] = strconv.Quote(c)
		}
		what := fmt.Sprintf("publication %q publishes %s with a column list that leaves out column %s: Postgres streams the rows without it",
			cfg.Publication, cfg.qualifiedTable(), strings.Join(cols, ", "))
		if slices.Contains(m.Left, cfg.Decoder.Columns.Headers) {
			what += " (without headers every user header, traceparent included, is dropped)"
		}
		out = append(out, memberProblem{What: what, Fix: "publish every column: " + republish,
			Loss: "the outbox rows committed since then were published without those columns"})
	}
	return out
}

// readMembership reads the membership over conn (a replication connection
// in database mode, or a normal one).
func readMembership(ctx context.Context, conn *pgconn.PgConn, cfg Config) (membership, error) {
	var m membership
	res, err := conn.Exec(ctx, "SELECT current_setting('server_version_num')").ReadAll()
	if err != nil {
		return m, fmt.Errorf("read server version: %w", err)
	}
	if len(res) != 1 || len(res[0].Rows) != 1 {
		return m, fmt.Errorf("read server version: no row")
	}
	num, err := strconv.Atoi(string(res[0].Rows[0][0]))
	if err != nil {
		return m, fmt.Errorf("parse server_version_num: %w", err)
	}
	pub, slot, table := quoteLiteral(cfg.Publication), quoteLiteral(cfg.Slot), quoteLiteral(cfg.quotedTable())
	// newer(x): x's xmin is not older than the slot's catalog_xmin (age()
	// measures back from the next xid, so an older xid has the greater age).
	// A negative age is an xmin "in the future": a row frozen over 2^31
	// xids ago keeps its raw xmin, which then reads so. It is older.
	newer := func(x string) string {
		return "coalesce((age(" + x + ".xmin) BETWEEN 0 AND (SELECT age(catalog_xmin) FROM pg_replication_slots WHERE slot_name = " + slot + "))::text, '')"
	}
	q := `WITH p AS (SELECT oid, xmin, puballtables FROM pg_publication WHERE pubname = ` + pub + `)
	SELECT 'publication', p.oid::text, p.xmin::text, ` + newer("p") + ` FROM p
	UNION ALL SELECT 'table', r.oid::text, r.xmin::text, ` + newer("r") + ` FROM pg_publication_rel r JOIN p ON r.prpubid = p.oid WHERE r.prrelid = to_regclass(` + table + `)
	UNION ALL SELECT 'all-tables', p.oid::text, p.xmin::text, ` + newer("p") + ` FROM p WHERE p.puballtables`
	if num >= 150000 {
		q += `
	UNION ALL SELECT 'schema', n.oid::text, n.xmin::text, ` + newer("n") + ` FROM pg_publication_namespace n JOIN p ON n.pnpubid = p.oid
		WHERE n.pnnspid = (SELECT c.relnamespace FROM pg_class c WHERE c.oid = to_regclass(` + table + `))`
	}
	res, err = conn.Exec(ctx, q).ReadAll()
	if err != nil {
		return m, fmt.Errorf("read the membership of %s in publication %q: %w", cfg.qualifiedTable(), cfg.Publication, err)
	}
	if len(res) != 1 {
		return m, fmt.Errorf("read the membership of %s: %d results", cfg.qualifiedTable(), len(res))
	}
	for _, row := range res[0].Rows {
		if len(row) != 4 {
			return m, fmt.Errorf("read the membership of %s: %d columns, want 4", cfg.qualifiedTable(), len(row))
		}
		xmin, newer := string(row[2]), string(row[3])
		m.SlotKnown = newer != ""
		if string(row[0]) == "publication" {
			m.PubXmin, m.PubNewer = xmin, newer == "true"
			continue
		}
		oid, err := strconv.ParseUint(string(row[1]), 10, 32)
		if err != nil {
			return m, fmt.Errorf("parse a publication row's OID: %w", err)
		}
		m.Rows = append(m.Rows, memberRow{Kind: string(row[0]), OID: uint32(oid), Xmin: xmin, Newer: newer == "true"})
	}
	if num < 150000 {
		return m, nil
	}
	// The row filter, and which configured columns the table has but the
	// column list leaves out (attnames lists every column without a list).
	c := cfg.Decoder.Columns
	var wanted []string
	for _, n := range []string{c.ID, c.AggregateType, c.AggregateID, c.EventType, c.Payload, c.Headers} {
		if n != "" {
			wanted = append(wanted, quoteLiteral(n))
		}
	}
	where := `t.pubname = ` + pub + ` AND t.schemaname = ` + quoteLiteral(cfg.Decoder.Schema) + ` AND t.tablename = ` + quoteLiteral(cfg.Decoder.Table)
	res, err = conn.Exec(ctx, `SELECT 'filter', coalesce(t.rowfilter, '') FROM pg_publication_tables t WHERE `+where+`
	UNION ALL SELECT 'left', a.attname FROM pg_publication_tables t, pg_attribute a
		WHERE `+where+` AND a.attrelid = to_regclass(`+table+`) AND a.attnum > 0 AND NOT a.attisdropped
		AND a.attname IN (`+strings.Join(wanted, ", ")+`) AND NOT a.attname = ANY (t.attnames)`).ReadAll()
	if err != nil {
		return m, fmt.Errorf("read the row filter and column list of %s in publication %q: %w", cfg.qualifiedTable(), cfg.Publication, err)
	}
	if len(res) != 1 {
		return m, fmt.Errorf("read the row filter of %s: %d results", cfg.qualifiedTable(), len(res))
	}
	for _, row := range res[0].Rows {
		if len(row) != 2 {
			return m, fmt.Errorf("read the row filter of %s: %d columns, want 2", cfg.qualifiedTable(), len(row))
		}
		switch string(row[0]) {
		case "filter":
			m.RowFilter = string(row[1])
		case "left":
			m.Left = append(m.Left, string(row[1]))
		}
	}
	return m, nil
}

// repairFix is the way out when rows may be missing from the stream: the
// slot goes, and jetbox repair publishes from the table what the stream
// misses and creates the slot again.
func repairFix(cfg Config, since string) string {
	repair := "`jetbox repair`"
	if since != "" {
		repair = "`jetbox repair --since " + since + "`"
	}
	return fmt.Sprintf("stop every jetbox on slot %q, drop the slot (SELECT pg_drop_replication_slot('%s')), run %s with the same configuration (it publishes from the table the rows the stream misses and creates the slot again), then start jetbox",
		cfg.Slot, strings.ReplaceAll(cfg.Slot, "'", "''"), repair)
}

// newerError explains a membership newer than the slot's position, found
// at start-up.
// How says how it is known.
func newerError(cfg Config, m membership, confirmed, how string) (what, fix string) {
	what = fmt.Sprintf("table %s was added to publication %q after the slot's position (confirmed to %s), or its membership changed since (dropped from the publication and added back, a row filter or column list changed, the publication altered): the catalog rows behind it (%s) %s. Postgres never streams rows committed while the table was not published, so outbox rows committed after %s may be missing from the stream",
		cfg.qualifiedTable(), cfg.Publication, confirmed, m.describe(), how, confirmed)
	fix = "restore the publication if it is not as it should be, then " + repairFix(cfg, "") +
		"; or, if those rows are in the stream already (re-published after an earlier error), start once with --accept-lost-rows"
	return what, fix
}

// changedError explains a membership that changed under jetbox: the rows
// behind it now are not those seen when it started.
func (s *Streamer) changedError(then, now membership, when, since string) error {
	cfg := s.cfg
	return &PermanentError{
		Err: fmt.Errorf("the membership of table %s in publication %q was re-created %s (catalog rows %s at start, now %s): it was dropped from the publication and added back, its row filter or column list changed, or the publication was altered (its publish setting, its owner). Postgres never streams rows committed while the table was not published (or filtered out), and jetbox may have confirmed the slot past them: outbox rows committed since then may be missing from the stream",
			cfg.qualifiedTable(), cfg.Publication, when, then.describe(), now.describe()),
		Hint: "fix: restore the publication if it is not as it should be, then " + repairFix(cfg, since),
	}
}

// checkMembership reads the outbox's membership in the publication over the
// replication connection, before streaming starts. A row filter or a column
// list leaving out a column jetbox reads stops jetbox. The first session
// records the membership for the monitor; a later one that finds none of
// its catalog rows stops jetbox: the membership was re-created meanwhile.
func (s *Streamer) checkMembership(ctx context.Context, conn *pgconn.PgConn) error {
	if !s.cfg.hasTable() {
		return nil
	}
	m, err := readMembership(ctx, conn, s.cfg)
	if err != nil {
		return err
	}
	if ps := m.problems(s.cfg); len(ps) > 0 {
		return &PermanentError{Err: errors.New(ps[0].What), Hint: "fix: " + ps[0].Fix + ", then " + repairFix(s.cfg, "")}
	}
	first := s.member.Load()
	switch {
	case len(m.Rows) == 0: // not a member: the publication check reports it
	case first == nil:
		s.member.Store(&m)
	case !continuous(*first, m):
		return s.changedError(*first, m, "while jetbox was reconnecting", "")
	}
	return nil
}
