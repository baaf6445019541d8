package replication

import (
	"context"
	"fmt"
	"regexp"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// AuditTable reads the outbox rows' ids and order keys for jetbox audit: the
// order key of jetbox repair (the commit timestamp with
// track_commit_timestamp on, else the created-at column), read in keyset
// pages on a connection of its own, each page a short statement (no long
// transaction holds back vacuum).
type AuditTable struct {
	mu   sync.Mutex // one query at a time on conn: Page may run beside Lookup
	conn *pgx.Conn
	// CommitTimestamps: rows are keyed by their commit timestamp.
	CommitTimestamps bool
	// Order describes the row order, e.g. "created_at, then id".
	Order string
	// Database is the database's name (current_database()): with the slot,
	// the Jetbox-Source writer whose messages carry this table's rows.
	Database string

	key, createdAt, id, table string
	uuid                      bool
	margin                    time.Duration
}

// AuditRow is one row: its id (text) and order key.
type AuditRow struct {
	ID  string
	Key time.Time
}

const uuidOID = 2950

// OpenAuditTable connects to Postgres and picks the order key as jetbox
// repair does (see OpenRepair); margin is the longest transaction, which
// bounds how long before its commit timestamp a row's created-at time may
// be.
func OpenAuditTable(ctx context.Context, connString string, cfg Config, createdAtColumn string, margin time.Duration) (*AuditTable, error) {
	pcfg, err := pgx.ParseConfig(connString)
	if err != nil {
		return nil, fmt.Errorf("parse postgres URL: %w", err)
	}
	for k, v := range pinnedParams {
		pcfg.RuntimeParams[k] = v
	}
	pcfg.RuntimeParams["application_name"] = "jetbox audit"
	// Pages read in (key, id) order with a LIMIT: an ordered index scan
	// reads just the page where an index leads with the key, while the
	// planner, with a table's statistics behind its growth, picks a bitmap
	// scan and a sort of the whole rest of the range for every page.
	pcfg.RuntimeParams["enable_bitmapscan"] = "off"
	pcfg.RuntimeParams["enable_sort"] = "off"
	conn, err := pgx.ConnectConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	r := &Repair{cfg: cfg, conn: conn}
	if err := conn.QueryRow(ctx, `SELECT current_setting('track_commit_timestamp')::bool`).Scan(&r.CommitTimestamps); err != nil {
		conn.Close(ctx)
		return nil, fmt.Errorf("read track_commit_timestamp: %w", err)
	}
	if err := r.columns(ctx, createdAtColumn); err != nil {
		conn.Close(ctx)
		return nil, err
	}
	var db string
	if err := conn.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		conn.Close(ctx)
		return nil, fmt.Errorf("read the database name: %w", err)
	}
	t := &AuditTable{conn: conn, CommitTimestamps: r.CommitTimestamps, Order: r.Order, Database: db, key: r.key, createdAt: r.createdAt,
		id: pgx.Identifier{cfg.Decoder.Columns.ID}.Sanitize(), table: cfg.quotedTable(), margin: margin}
	for _, c := range r.cols {
		if c.Name == cfg.Decoder.Columns.ID {
			t.uuid = c.TypeOID == uuidOID
		}
	}
	return t, nil
}

// Close closes the connection.
func (t *AuditTable) Close(ctx context.Context) {
	t.mu.Lock()
	defer t.mu.Unlock()
	_ = t.conn.Close(ctx)
}

// Oldest returns the smallest order key the table holds; ok is false when
// it holds no row with one.
func (t *AuditTable) Oldest(ctx context.Context) (time.Time, bool, error) {
	var key *time.Time
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.conn.QueryRow(ctx, "SELECT min("+t.key+") FROM "+t.table).Scan(&key); err != nil {
		return time.Time{}, false, fmt.Errorf("read the oldest outbox row: %w", err)
	}
	if key == nil {
		return time.Time{}, false, nil
	}
	return key.UTC(), true, nil
}

// Filtered reports whether Page bounds its scan by the created-at column
// (commit timestamps on and a created-at column): a row inserted more than
// one margin before its commit is then not read, and Count tells.
func (t *AuditTable) Filtered() bool { return t.CommitTimestamps && t.createdAt != "" }

// Count returns how many rows have since <= key <= until, read without the
// created-at bound of Page (one scan of the table).
func (t *AuditTable) Count(ctx context.Context, since, until time.Time) (int64, error) {
	var n int64
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.conn.QueryRow(ctx, "SELECT count(*) FROM "+t.table+" WHERE "+t.key+" >= $1 AND "+t.key+" <= $2", since, until).Scan(&n); err != nil {
		return 0, fmt.Errorf("count the outbox rows of the range: %w", err)
	}
	return n, nil
}

// NullKeys returns how many rows have no order key (no commit timestamp,
// frozen or from before track_commit_timestamp, and no created-at value):
// they belong to no range, so no audit can tell whether they reached the
// stream.
func (t *AuditTable) NullKeys(ctx context.Context) (int64, error) {
	var n int64
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.conn.QueryRow(ctx, "SELECT count(*) FROM "+t.table+" WHERE "+t.key+" IS NULL").Scan(&n); err != nil {
		return 0, fmt.Errorf("count the outbox rows without an order key: %w", err)
	}
	return n, nil
}

// Page returns up to n rows with since <= key <= until after (afterKey,
// afterID) in (key, id) order; first: no row before (the range's first
// page). Rows without an order key (no commit timestamp and no created-at
// column) are not in any range.
func (t *AuditTable) Page(ctx context.Context, since, until time.Time, first bool, afterKey time.Time, afterID string, n int) ([]AuditRow, error) {
	// The id's text gets another name than the column: ORDER BY then
	// sorts by the column, in the order of an index on (created_at, id),
	// not by its text (which makes every page sort the whole range).
	q := "SELECT " + t.id + "::text AS jetbox_row_id, (extract(epoch FROM " + t.key + ") * 1000000)::bigint FROM " + t.table +
		" WHERE " + t.key + " >= $1 AND " + t.key + " <= $2"
	args := []any{since, until}
	if t.CommitTimestamps && t.createdAt != "" {
		// A row whose commit timestamp is at or after from was inserted
		// at most one margin earlier: an index on the created-at column
		// bounds the page's scan.
		from := since
		if !first {
			from = afterKey
		}
		q += " AND " + t.createdAt + " >= $3"
		args = append(args, from.Add(-t.margin))
	}
	if !first {
		q += fmt.Sprintf(" AND (%s, %s) > ($%d, $%d)", t.key, t.id, len(args)+1, len(args)+2)
		args = append(args, afterKey, afterID)
	}
	q += fmt.Sprintf(" ORDER BY %s, %s LIMIT %d", t.key, t.id, n)
	t.mu.Lock()
	defer t.mu.Unlock()
	rows, err := t.conn.Query(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("read the outbox rows: %w", err)
	}
	out := make([]AuditRow, 0, n)
	for rows.Next() {
		var id string
		var us int64
		if err := rows.Scan(&id, &us); err != nil {
			return nil, fmt.Errorf("read the outbox rows: %w", err)
		}
		out = append(out, AuditRow{ID: id, Key: time.UnixMicro(us).UTC()})
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read the outbox rows: %w", err)
	}
	return out, nil
}

var uuidText = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

// Lookup returns the order keys of the ids the table holds (a row without
// an order key is left out). With a uuid id column, ids that are not a
// uuid's text are not asked for.
func (t *AuditTable) Lookup(ctx context.Context, ids []string) (map[string]time.Time, error) {
	ask := ids
	if t.uuid {
		ask = make([]string, 0, len(ids))
		for _, id := range ids {
			if uuidText.MatchString(id) {
				ask = append(ask, id)
			}
		}
	}
	out := map[string]time.Time{}
	if len(ask) == 0 {
		return out, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	rows, err := t.conn.Query(ctx, "SELECT "+t.id+"::text, (extract(epoch FROM "+t.key+") * 1000000)::bigint FROM "+t.table+
		" WHERE "+t.id+" = ANY($1) AND "+t.key+" IS NOT NULL", ask)
	if err != nil {
		return nil, fmt.Errorf("look up outbox ids: %w", err)
	}
	for rows.Next() {
		var id string
		var us int64
		if err := rows.Scan(&id, &us); err != nil {
			return nil, fmt.Errorf("look up outbox ids: %w", err)
		}
		out[id] = time.UnixMicro(us).UTC()
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("look up outbox ids: %w", err)
	}
	return out, nil
}
