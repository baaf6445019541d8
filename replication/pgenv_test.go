package replication

import "testing"

// TestReplicationConfigReadsPGUserPassword: a URL without user or password
// takes them from PGUSER and PGPASSWORD (the Helm chart's
// postgres.userSecret/passwordSecret, e.g. CloudNativePG's basic-auth
// Secret), and a URL's own user and password win over them.
func TestReplicationConfigReadsPGUserPassword(t *testing.T) {
	t.Setenv("PGUSER", "app")
	t.Setenv("PGPASSWORD", "s3cret")
	cc, err := replicationConfig("postgres://db-rw.db:5432/app?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	if cc.User != "app" || cc.Password != "s3cret" {
		t.Errorf("user %q password %q, want PGUSER and PGPASSWORD", cc.User, cc.Password)
	}
	cc, err = replicationConfig("postgres://jetbox:pw@db-rw.db:5432/app?sslmode=disable")
	if err != nil {
		t.Fatal(err)
	}
	if cc.User != "jetbox" || cc.Password != "pw" {
		t.Errorf("user %q password %q, want the URL's", cc.User, cc.Password)
	}
}
