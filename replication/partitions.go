package replication

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jetbox-dev/jetbox/decoder"
)

// leavesPublishedSQL tells whether publication $1 publishes the
// partitioned table $2 (a quoted name) without publish_via_partition_root:
// pg_publication_tables then lists its partitions instead of it, and
// pgoutput names its rows after the leaf partition each is stored in.
const leavesPublishedSQL = `SELECT EXISTS (SELECT 1 FROM pg_publication p, pg_class t, pg_publication_tables pt
	WHERE p.pubname = $1 AND NOT p.pubviaroot AND t.oid = to_regclass($2) AND t.relkind = 'p'
	AND pt.pubname = p.pubname AND to_regclass(quote_ident(pt.schemaname) || '.' || quote_ident(pt.tablename)) IN (SELECT relid FROM pg_partition_tree(t.oid)))`

// viaRootFix is the statement that makes pgoutput name a partitioned
// outbox's rows after the outbox again.
func viaRootFix(cfg Config) string {
	return fmt.Sprintf("ALTER PUBLICATION %s SET (publish_via_partition_root = true)", quoteIdent(cfg.Publication))
}

// outboxPartitions is a partitioned outbox's tree, as the catalog said.
type outboxPartitions struct {
	Root uint32   // the outbox's OID; 0: it is not a partitioned table
	OIDs []uint32 // its partitions at every depth
	// Exclusive: the publication publishes the outbox alone (no other
	// table, schema or ALL TABLES), so every other table pgoutput streams
	// in it was one of the outbox's partitions when its rows were written.
	Exclusive bool
}

// readPartitions reads the outbox's partitions over conn (a replication
// connection in database mode, or a normal one).
func readPartitions(ctx context.Context, conn *pgconn.PgConn, cfg Config) (outboxPartitions, error) {
	var out outboxPartitions
	table := quoteLiteral(cfg.quotedTable())
	res, err := conn.Exec(ctx, `SELECT 'root', oid::text FROM pg_class WHERE oid = to_regclass(`+table+`) AND relkind = 'p'
	UNION ALL SELECT 'partition', relid::oid::text FROM pg_partition_tree(to_regclass(`+table+`)) WHERE relid <> to_regclass(`+table+`)`).ReadAll()
	if err != nil {
		return out, fmt.Errorf("read the partitions of %s: %w", cfg.qualifiedTable(), err)
	}
	if len(res) != 1 {
		return out, fmt.Errorf("read the partitions of %s: %d results", cfg.qualifiedTable(), len(res))
	}
	for _, row := range res[0].Rows {
		if len(row) != 2 {
			return out, fmt.Errorf("read the partitions of %s: %d columns, want 2", cfg.qualifiedTable(), len(row))
		}
		oid, err := strconv.ParseUint(string(row[1]), 10, 32)
		if err != nil {
			return out, fmt.Errorf("parse the OID of %s or a partition: %w", cfg.qualifiedTable(), err)
		}
		if string(row[0]) == "root" {
			out.Root = uint32(oid)
			continue
		}
		out.OIDs = append(out.OIDs, uint32(oid))
	}
	if out.Root == 0 {
		return out, nil
	}
	if out.Exclusive, err = publishesOutboxAlone(ctx, conn, cfg); err != nil {
		return out, err
	}
	return out, nil
}

// publishesOutboxAlone reports whether cfg's publication publishes the
// outbox and nothing else.
func publishesOutboxAlone(ctx context.Context, conn *pgconn.PgConn, cfg Config) (bool, error) {
	res, err := conn.Exec(ctx, "SELECT current_setting('server_version_num')").ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 {
		return false, fmt.Errorf("read the server version: %w", err)
	}
	num, err := strconv.Atoi(string(res[0].Rows[0][0]))
	if err != nil {
		return false, fmt.Errorf("parse server_version_num: %w", err)
	}
	pub, table := quoteLiteral(cfg.Publication), quoteLiteral(cfg.quotedTable())
	q := `SELECT (NOT p.puballtables AND NOT EXISTS (SELECT 1 FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid <> to_regclass(` + table + `))`
	if num >= 150000 {
		q += ` AND NOT EXISTS (SELECT 1 FROM pg_publication_namespace n WHERE n.pnpubid = p.oid)`
	}
	q += `)::text FROM pg_publication p WHERE p.pubname = ` + pub
	res, err = conn.Exec(ctx, q).ReadAll()
	if err != nil {
		return false, fmt.Errorf("read what publication %q publishes: %w", cfg.Publication, err)
	}
	return len(res) == 1 && len(res[0].Rows) == 1 && string(res[0].Rows[0][0]) == "true", nil
}

// setPartitions tells dec a partitioned outbox's partitions, with a lookup
// for those attached later; it returns what closes the lookup's connection.
func setPartitions(dec *decoder.Decoder, parts outboxPartitions, connString string) (closeLookup func()) {
	if parts.Root == 0 {
		return func() {}
	}
	lookup := &partitionLookup{connString: connString, root: parts.Root, exclusive: parts.Exclusive}
	dec.SetPartitions(parts.OIDs, lookup.isPartition)
	return lookup.close
}

// partitionLookup answers the decoder's question about a table it does not
// know (see decoder.PartitionLookup) over a normal connection of its own,
// opened at the first question: the replication connection is streaming.
type partitionLookup struct {
	connString string
	root       uint32 // the outbox's OID
	exclusive  bool   // the publication publishes the outbox alone
	conn       *pgx.Conn
}

// isPartition reports whether the relation oid was a partition of the
// outbox when its rows were written. pgoutput streams a table's rows by
// the publication as it was then, and the catalog says what the table is
// now: a partition detached or dropped since (an outbox pruned by
// dropping old partitions) is no partition any more. So in a publication
// of the outbox alone every other table is taken for one of its
// partitions; in one that publishes other tables too, a table the catalog
// does not place under the outbox is another table (see
// decoder.PartitionLookup for what the decoder does with one that has the
// outbox's columns).
func (p *partitionLookup) isPartition(oid uint32, _ string) (bool, error) {
	if p.exclusive {
		return true, nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if p.conn == nil || p.conn.IsClosed() {
		cfg, err := pgx.ParseConfig(p.connString)
		if err != nil {
			return false, fmt.Errorf("parse postgres URL: %w", err)
		}
		cfg.RuntimeParams["application_name"] = "jetbox partition lookup"
		if p.conn, err = pgx.ConnectConfig(ctx, cfg); err != nil {
			return false, fmt.Errorf("connect to postgres (jetbox reconnects and asks again): %w", err)
		}
	}
	var ok bool
	err := p.conn.QueryRow(ctx, "SELECT coalesce(pg_partition_root($1::oid::regclass)::oid = $2::oid, false)", oid, p.root).Scan(&ok)
	if err != nil {
		p.close()
		return false, fmt.Errorf("look it up in the catalog (jetbox reconnects and asks again): %w", err)
	}
	return ok, nil
}

// close closes the lookup's connection, if open.
func (p *partitionLookup) close() {
	if p.conn != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		p.conn.Close(ctx)
		p.conn = nil
	}
}
