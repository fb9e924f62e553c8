# Sourced by scripts/fetch_deps.sh and scripts/arm64_env.sh: download Debian packages with a
# private apt state (own sources list, lists, cache) so the system's apt state is untouched. The
# archive URI is read from this machine's own apt sources; no host is named here.
#   debian_init            sets TMP (removed on exit), URI, KEYRING
#   fetch_pkg SUITE ARCH PKG DEST     download PKG:ARCH and unpack it into DEST (replaced)
#   fetch_pkgs SUITE ARCH DEST PKG... download the PKGs and unpack them all into DEST (kept)

archive_uri() {
  local f uri
  # deb822 sources: first URIs: line of a non-security paragraph.
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f "$f" ]] || continue
    uri="$(awk 'BEGIN{RS=""; FS="\n"}
      { u=""; s=""
        for (i=1;i<=NF;i++) { if ($i ~ /^URIs:/) { sub(/^URIs:[ \t]*/,"",$i); split($i,a,/[ \t]+/); u=a[1] }
                              if ($i ~ /^Suites:/) s=$i }
        if (u != "" && u !~ /security/ && s !~ /security/) { print u; exit } }' "$f")"
    if [[ -n "$uri" ]]; then echo "$uri"; return 0; fi
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f "$f" ]] || continue
    uri="$(awk '$1=="deb" { for (i=2;i<=NF;i++) if ($i ~ /^[a-z+]+:\/\//) { if ($i !~ /security/) { print $i; exit } ; break } }' "$f")"
    if [[ -n "$uri" ]]; then echo "$uri"; return 0; fi
  done
  return 1
}

debian_init() {
  local tool
  for tool in apt-get dpkg; do
    command -v "$tool" >/dev/null 2>&1 || {
      echo "$(basename "$0"): '$tool' not found; these files come from Debian packages" >&2
      exit 1; }
  done
  URI="$(archive_uri)" || { echo "$(basename "$0"): no Debian archive URI found in the apt sources" >&2; exit 1; }
  KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
}

apt_private() {  # $1 = suite, $2 = architecture, rest = apt-get args
  local suite="$1" arch="$2"; shift 2
  local st="$TMP/$suite-$arch"
  mkdir -p "$st/lists/partial" "$st/cache/archives/partial"
  echo "deb [signed-by=$KEYRING] $URI $suite main" > "$st/sources.list"
  local opts=(
    -o Dir::Etc::SourceList="$st/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o Dir::State::Lists="$st/lists" -o Dir::Cache="$st/cache"
    -o Dir::Cache::pkgcache= -o Dir::Cache::srcpkgcache=
    -o APT::Architecture="$arch" -o APT::Architectures="$arch" -o Acquire::Languages=none
    -o Acquire::IndexTargets::deb::Contents-deb::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::Contents-udeb::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false
    -o Acquire::IndexTargets::deb::CNF::DefaultEnabled=false
    -o Debug::NoLocking=true -o APT::Sandbox::User=root
  )
  apt-get -q "${opts[@]}" "$@"
}

_download() {  # suite arch dir pkg...
  local suite="$1" arch="$2" dir="$3"; shift 3
  [[ -f "$TMP/$suite-$arch/updated" ]] || {
    apt_private "$suite" "$arch" update >/dev/null; touch "$TMP/$suite-$arch/updated"; }
  mkdir -p "$dir"
  (cd "$dir" && apt_private "$suite" "$arch" download "${@/%/:$arch}" >/dev/null)
}

fetch_pkg() {  # suite arch package destdir
  local suite="$1" arch="$2" pkg="$3" dest="$4"
  _download "$suite" "$arch" "$TMP/dl-$pkg" "$pkg"
  rm -rf "$dest"; mkdir -p "$dest"
  dpkg -x "$TMP/dl-$pkg"/*.deb "$dest"
}

fetch_pkgs() {  # suite arch destdir package...
  local suite="$1" arch="$2" dest="$3" deb; shift 3
  _download "$suite" "$arch" "$TMP/dl-$suite-$arch" "$@"
  mkdir -p "$dest"
  for deb in "$TMP/dl-$suite-$arch"/*.deb; do dpkg -x "$deb" "$dest"; done
}
