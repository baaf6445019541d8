package replication

import (
	"context"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
)

// This file reads the outbox table's columns as pgoutput will send them, so
// that jetbox check, start-up, repair and the stream judge a table alike:
// domains by their base types (the session gives the decoder the same
// mapping), and generated columns only where pgoutput sends them.

// readDomains returns every domain of the database with the type it is
// declared over, for the decoder (see decoder.Domains).
func readDomains(ctx context.Context, conn *pgconn.PgConn) (decoder.Domains, error) {
	res, err := conn.Exec(ctx, "SELECT oid::text, typbasetype::text FROM pg_type WHERE typtype = 'd'").ReadAll()
	if err != nil {
		return nil, fmt.Errorf("read the domains (pg_type): %w", err)
	}
	if len(res) != 1 {
		return nil, fmt.Errorf("read the domains (pg_type): %d results", len(res))
	}
	d := make(decoder.Domains, len(res[0].Rows))
	for _, row := range res[0].Rows {
		oid, err1 := strconv.ParseUint(string(row[0]), 10, 32)
		base, err2 := strconv.ParseUint(string(row[1]), 10, 32)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("read the domains (pg_type): bad row %q", row)
		}
		d[uint32(oid)] = uint32(base)
	}
	return d, nil
}

// columnProblem is an outbox column pgoutput will not send, and the fix.
type columnProblem struct{ msg, fix string }

// tableColumns is the outbox table as pgoutput will describe it.
type tableColumns struct {
	// cols: every column, in attnum order, domains resolved to their base
	// types.
	cols []decoder.TableColumn
	// problems: outbox columns that are generated where pgoutput does not
	// send generated columns (before PostgreSQL 18; on 18 unless the
	// publication has publish_generated_columns = stored; virtual ones
	// never). Every row would stop on them (table-changed).
	problems []columnProblem
	// publishGenerated: an outbox column is a stored generated column on
	// PostgreSQL 18+, so the publication jetbox creates must publish
	// generated columns.
	publishGenerated bool
}

// readColumns reads the outbox table's columns (see tableColumns). The
// table must exist.
func readColumns(ctx context.Context, conn *pgconn.PgConn, cfg Config) (tableColumns, error) {
	var t tableColumns
	domains, err := readDomains(ctx, conn)
	if err != nil {
		return t, err
	}
	// pubgencols: PostgreSQL 18 ('n' or 's'); '-': no such publication.
	res, err := conn.Exec(ctx, `SELECT a.attname, a.atttypid::text, a.attgenerated::text, current_setting('server_version_num'),
		coalesce((SELECT coalesce(to_jsonb(p) ->> 'pubgencols', 'n') FROM pg_publication p WHERE p.pubname = `+quoteLiteral(cfg.Publication)+`), '-')
		FROM pg_attribute a WHERE a.attrelid = `+quoteLiteral(cfg.quotedTable())+`::regclass AND a.attnum > 0 AND NOT a.attisdropped
		ORDER BY a.attnum`).ReadAll()
	if err != nil {
		return t, fmt.Errorf("read the columns of %s: %w", cfg.qualifiedTable(), err)
	}
	if len(res) != 1 {
		return t, fmt.Errorf("read the columns of %s: %d results", cfg.qualifiedTable(), len(res))
	}
	c := cfg.Decoder.Columns
	outbox := map[string]bool{c.ID: true, c.AggregateType: true, c.AggregateID: true, c.EventType: true, c.Payload: true}
	if c.Headers != "" {
		outbox[c.Headers] = true
	}
	for _, row := range res[0].Rows {
		name, generated, version, pubGen := string(row[0]), string(row[2]), string(row[3]), string(row[4])
		oid, err := strconv.ParseUint(string(row[1]), 10, 32)
		if err != nil {
			return t, fmt.Errorf("read the columns of %s: type oid %q: %w", cfg.qualifiedTable(), row[1], err)
		}
		t.cols = append(t.cols, decoder.TableColumn{Name: name, TypeOID: domains.BaseType(uint32(oid))})
		if generated == "" || !outbox[name] {
			continue
		}
		num, _ := strconv.Atoi(version)
		col := fmt.Sprintf("column %q is a generated column", name)
		dropExpr := fmt.Sprintf("ALTER TABLE %s ALTER COLUMN %s DROP EXPRESSION (it keeps its values; then the producer, or a BEFORE INSERT trigger, sets it)", cfg.quotedTable(), quoteIdent(name))
		switch {
		case generated == "v":
			t.problems = append(t.problems, columnProblem{col + " (VIRTUAL): pgoutput never sends virtual generated columns, so every row would stop (table-changed: the column is missing)",
				"make it a plain column the producer (or a BEFORE INSERT trigger) sets, or a STORED generated column with the publication's publish_generated_columns = stored"})
		case num < 180000:
			t.problems = append(t.problems, columnProblem{col + ": pgoutput before PostgreSQL 18 never sends generated columns, so every row would stop (table-changed: the column is missing)",
				dropExpr + "; or, on PostgreSQL 18, publish generated columns (publish_generated_columns = stored)"})
		case pubGen == "-": // jetbox creates the publication
			t.publishGenerated = true
		case pubGen != "s":
			t.problems = append(t.problems, columnProblem{fmt.Sprintf("%s and publication %q does not publish generated columns (publish_generated_columns = none), so pgoutput does not send it: every row would stop (table-changed: the column is missing)", col, cfg.Publication),
				fmt.Sprintf("ALTER PUBLICATION %s SET (publish_generated_columns = stored); or %s", quoteIdent(cfg.Publication), dropExpr)})
		}
	}
	return t, nil
}
