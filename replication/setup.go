package replication

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
	"github.com/rs/zerolog"
)

// Problem is one thing wrong with the Postgres side, with its fix.
type Problem struct {
	What string
	Fix  string
}

func (p Problem) String() string { return p.What + "; fix: " + p.Fix }

// ProblemsError carries every set-up problem found in one pass.
type ProblemsError struct{ Problems []Problem }

func (e *ProblemsError) Error() string {
	parts := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		parts[i] = p.String()
	}
	return strings.Join(parts, "\n")
}

// Setup checks the Postgres side and creates what is missing: the publication
// (FOR TABLE <table> WITH (publish = 'insert', publish_via_partition_root)),
// then the permanent pgoutput slot. It reports every problem at once as a
// *ProblemsError. A connection failure is returned as such (wrapped), so the
// caller can retry it.
func Setup(ctx context.Context, connString string, cfg Config, log zerolog.Logger) error {
	pcfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return &ProblemsError{Problems: []Problem{{What: "postgres URL: " + err.Error(), Fix: "pass a libpq URL or DSN, e.g. postgres://user:pass@host:5432/db?sslmode=disable"}}}
	}
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))

	var probs []Problem
	add := func(what, fix string) { probs = append(probs, Problem{What: what, Fix: fix}) }

	var walLevel string
	if err := conn.QueryRow(ctx, "SHOW wal_level").Scan(&walLevel); err != nil {
		return fmt.Errorf("read wal_level: %w", err)
	}
	if walLevel != "logical" {
		add(fmt.Sprintf("wal_level is %q", walLevel), "ALTER SYSTEM SET wal_level = logical; then restart Postgres")
	}

	tableOK := checkTable(ctx, conn, cfg, add)
	pubOK := false
	if tableOK {
		pubOK = ensurePublication(ctx, conn, cfg, add, log)
	}
	if pubOK && walLevel == "logical" {
		ensureSlot(ctx, conn, cfg, add, log)
	}
	if len(probs) > 0 {
		return &ProblemsError{Problems: probs}
	}
	return nil
}

func checkTable(ctx context.Context, conn *pgx.Conn, cfg Config, add func(string, string)) bool {
	var persistence, kind string
	err := conn.QueryRow(ctx, `SELECT c.relpersistence::text, c.relkind::text FROM pg_class c
		JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND c.relname = $2`,
		cfg.Decoder.Schema, cfg.Decoder.Table).Scan(&persistence, &kind)
	if errors.Is(err, pgx.ErrNoRows) {
		add(fmt.Sprintf("table %s does not exist", cfg.qualifiedTable()),
			"create it (see the outbox DDL in the README) or set --table to the outbox table")
		return false
	}
	if err != nil {
		add("look up table "+cfg.qualifiedTable()+": "+err.Error(), "check the role may read the catalog and the table")
		return false
	}
	ok := true
	if persistence != "p" {
		add(fmt.Sprintf("table %s is unlogged or temporary: its rows never reach the WAL", cfg.qualifiedTable()),
			"ALTER TABLE "+cfg.qualifiedTable()+" SET LOGGED")
		ok = false
	}
	if kind != "r" && kind != "p" {
		add(fmt.Sprintf("%s is not a table (relkind %q)", cfg.qualifiedTable(), kind), "point --table at the outbox table")
		return false
	}
	rows, err := conn.Query(ctx, `SELECT a.attname, CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE a.atttypid END
		FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
		WHERE a.attrelid = $1::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum`, cfg.qualifiedTable())
	if err != nil {
		add("read columns of "+cfg.qualifiedTable()+": "+err.Error(), "check the role may read the table")
		return false
	}
	cols, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (decoder.TableColumn, error) {
		var c decoder.TableColumn
		return c, r.Scan(&c.Name, &c.TypeOID)
	})
	if err != nil {
		add("read columns of "+cfg.qualifiedTable()+": "+err.Error(), "check the role may read the table")
		return false
	}
	_, problems := decoder.CheckColumns(cfg.Decoder.Columns, cols)
	for _, p := range problems {
		add("table "+cfg.qualifiedTable()+": "+p, "alter the table to match the outbox DDL in the README, or set the --*-column flags to its column names")
		ok = false
	}
	return ok
}

func ensurePublication(ctx context.Context, conn *pgx.Conn, cfg Config, add func(string, string), log zerolog.Logger) bool {
	var insert bool
	err := conn.QueryRow(ctx, "SELECT pubinsert FROM pg_publication WHERE pubname = $1", cfg.Publication).Scan(&insert)
	if errors.Is(err, pgx.ErrNoRows) {
		sql := fmt.Sprintf("CREATE PUBLICATION %s FOR TABLE %s WITH (publish = 'insert', publish_via_partition_root = true)",
			pgx.Identifier{cfg.Publication}.Sanitize(), cfg.quotedTable())
		if _, err := conn.Exec(ctx, sql); err != nil {
			add(fmt.Sprintf("create publication %q: %v", cfg.Publication, err),
				"grant the role CREATE on the database and ownership of the table, or run as an administrator: "+sql)
			return false
		}
		log.Info().Str("publication", cfg.Publication).Str("table", cfg.qualifiedTable()).Msg("created publication")
		return true
	}
	if err != nil {
		add("look up publication "+cfg.Publication+": "+err.Error(), "check the role may read pg_publication")
		return false
	}
	ok := true
	if !insert {
		add(fmt.Sprintf("publication %q does not publish inserts", cfg.Publication),
			fmt.Sprintf("ALTER PUBLICATION %s SET (publish = 'insert')", pgx.Identifier{cfg.Publication}.Sanitize()))
		ok = false
	}
	var n int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
		cfg.Publication, cfg.Decoder.Schema, cfg.Decoder.Table).Scan(&n); err != nil {
		add("read publication tables: "+err.Error(), "check the role may read pg_publication_tables")
		return false
	}
	if n == 0 {
		add(fmt.Sprintf("publication %q does not contain %s", cfg.Publication, cfg.qualifiedTable()),
			fmt.Sprintf("ALTER PUBLICATION %s ADD TABLE %s", pgx.Identifier{cfg.Publication}.Sanitize(), cfg.quotedTable()))
		ok = false
	}
	return ok
}

func ensureSlot(ctx context.Context, conn *pgx.Conn, cfg Config, add func(string, string), log zerolog.Logger) {
	var (
		plugin, slotType, walStatus string
		db, current                 string
		twoPhase                    bool
		confirmed                   string
	)
	err := conn.QueryRow(ctx, `SELECT coalesce(plugin, ''), slot_type, coalesce(database, ''), current_database(),
		coalesce(wal_status, ''), two_phase, coalesce(confirmed_flush_lsn::text, '0/0')
		FROM pg_replication_slots WHERE slot_name = $1`, cfg.Slot).
		Scan(&plugin, &slotType, &db, &current, &walStatus, &twoPhase, &confirmed)
	if errors.Is(err, pgx.ErrNoRows) {
		var lsn string
		if err := conn.QueryRow(ctx, "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false)", cfg.Slot).Scan(&lsn); err != nil {
			fix := "grant the role REPLICATION (ALTER ROLE ... REPLICATION) and check max_replication_slots has a free slot"
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "53400" {
				fix = "raise max_replication_slots (and restart Postgres) or drop an unused slot"
			}
			add(fmt.Sprintf("create replication slot %q: %v", cfg.Slot, err), fix)
			return
		}
		log.Warn().Str("slot", cfg.Slot).Str("lsn", lsn).
			Msg("created replication slot: outbox rows committed before this LSN are not streamed")
		return
	}
	if err != nil {
		add("look up slot "+cfg.Slot+": "+err.Error(), "check the role may read pg_replication_slots")
		return
	}
	drop := fmt.Sprintf("SELECT pg_drop_replication_slot('%s') (rows not yet forwarded are then lost) or set --slot to another name", cfg.Slot)
	switch {
	case slotType != "logical" || plugin != "pgoutput":
		add(fmt.Sprintf("slot %q is a %s slot with plugin %q, not a logical pgoutput slot", cfg.Slot, slotType, plugin), drop)
	case db != current:
		add(fmt.Sprintf("slot %q belongs to database %q, not %q", cfg.Slot, db, current), "connect to database "+db+" or set --slot to another name")
	case walStatus == "lost":
		add(fmt.Sprintf("slot %q is invalidated (wal_status = lost): WAL it needed was removed, events were lost", cfg.Slot),
			"re-publish the missing rows from the table, then "+drop)
	case twoPhase:
		add(fmt.Sprintf("slot %q has two_phase enabled: prepared transactions would be published before they commit", cfg.Slot), drop)
	default:
		log.Info().Str("slot", cfg.Slot).Str("confirmed_lsn", confirmed).Msg("using existing replication slot")
	}
}
