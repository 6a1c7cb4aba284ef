package doctest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// recorder is a testing.TB that records Errorf calls instead of failing the test.
type recorder struct {
	testing.TB
	errs []string
}

func (r *recorder) Helper() {}

func (r *recorder) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

func write(t *testing.T, dir, name, text string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestShowsFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	src := write(t, dir, "example_test.go", "package x_test\n\nimport \"fmt\"\n\nfunc Example() {\n\tfmt.Println(1)\n}\n")
	tests := []struct {
		name   string
		readme string
		want   []string // Errorf messages, each by its start
	}{
		{name: "Identical", readme: "# x\n\n```go\nimport \"fmt\"\n\nfunc Example() {\n\tfmt.Println(1)\n}\n```\n"},
		{name: "IdenticalAmongOthers", readme: "```go\nx := 1\n```\n\ntext\n\n```go\n\nimport \"fmt\"\n\nfunc Example() {\n\tfmt.Println(1)\n}\n\n```\n"},
		{
			name:   "OneLineDiffers",
			readme: "```go\nimport \"fmt\"\n\nfunc Example() {\n\tfmt.Println(2)\n}\n```\n",
			want: []string{
				`README.md shows ` + src + ` differently: line 4 of its block is "\tfmt.Println(2)", the file has "\tfmt.Println(1)"`,
				`README.md has no ` + "```go" + ` block identical to ` + src,
			},
		},
		{name: "NotAGoBlock", readme: "```\nimport \"fmt\"\n\nfunc Example() {\n\tfmt.Println(1)\n}\n```\n",
			want: []string{`README.md has no ` + "```go" + ` block identical to ` + src}},
		{name: "Missing", readme: "# nothing here\n", want: []string{`README.md has no ` + "```go" + ` block identical to ` + src}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			readme := write(t, t.TempDir(), "README.md", tc.readme)
			r := &recorder{TB: t}
			ShowsFile(r, readme, src)
			if len(r.errs) != len(tc.want) {
				t.Fatalf("errors = %q, want %d starting %q", r.errs, len(tc.want), tc.want)
			}
			for i, e := range r.errs {
				e = strings.ReplaceAll(e, readme, "README.md")
				if !strings.HasPrefix(e, tc.want[i]) {
					t.Errorf("error %d = %q, want it to start %q", i+1, e, tc.want[i])
				}
			}
		})
	}
}

func TestGoBlocks(t *testing.T) {
	t.Parallel()
	md := "text\n```go\na\n\nb\n```\n```\nplain\n```\n  ```go\n\nc\n\n  ```\n```go\nunclosed"
	got := GoBlocks(md)
	want := []string{"a\n\nb", "c", "unclosed"}
	if fmt.Sprint(got) != fmt.Sprint(want) || len(got) != len(want) {
		t.Errorf("GoBlocks = %q, want %q", got, want)
	}
}
