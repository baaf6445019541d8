package format

import "testing"

func TestOrigin(t *testing.T) {
	for _, o := range []Origin{
		{"7300000000000000001", 1, "app", "jetbox"},
		{"42", 3, "a/b", "jetbox"},
		{"42", 2, "50% off/x", "s"},
		{"42", 1, "über db", "jetbox_1"},
	} {
		got, ok := ParseOrigin(o.String())
		if !ok || got != o {
			t.Errorf("ParseOrigin(%q) = %+v, %v; want %+v", o.String(), got, ok, o)
		}
	}
	if s := (Origin{"42", 1, "app", "jetbox"}).String(); s != "42/1/app/jetbox" {
		t.Errorf("plain names encode as before: %q", s)
	}
	a, b := Origin{"42", 1, "a/b", "s"}, Origin{"42", 2, "a/b", "s"}
	if !SameWriter(a.String(), b.String()) {
		t.Error("a failover (another timeline) is the same writer")
	}
	if SameWriter(a.String(), Origin{"42", 1, "a/c", "s"}.String()) || SameWriter(a.String(), Origin{"43", 1, "a/b", "s"}.String()) {
		t.Error("another database or system is another writer")
	}
	for _, bad := range []string{"", "x", "42/x/app/s", "42/1/a/b/c", "/1/a/b", "42/1/%zz/s"} {
		if _, ok := ParseOrigin(bad); ok {
			t.Errorf("ParseOrigin(%q) ok", bad)
		}
	}
	if !SameWriter("foreign", "foreign") || SameWriter("foreign", "42/1/app/s") {
		t.Error("an unparsed value is only its own writer")
	}
}
