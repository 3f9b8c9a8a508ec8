"""Signs the requests in a JSON-lines file with botocore's S3 SigV4 signer and compares the
Authorization header with the one Strata's signer produced. Prints one line per mismatch and a
final "checked N, mismatches M"; exits 1 on any mismatch.

Each line: {method, scheme, host, path, query: [[name, value]...], headers: {..}, body_hex,
unsigned, access_key, secret_key, token, region, amz_date, authorization}.
"""
import datetime
import json
import sys
from unittest import mock
from urllib.parse import quote

from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials


def main(path):
    checked = mismatches = 0
    for line in open(path):
        case = json.loads(line)
        url = case["scheme"] + "://" + case["host"] + quote(case["path"], safe="/~")
        if case["query"]:
            url += "?" + "&".join(quote(k, safe="~") + "=" + quote(v, safe="~") for k, v in case["query"])
        request = AWSRequest(method=case["method"], url=url, headers=dict(case["headers"]),
                             data=bytes.fromhex(case["body_hex"]))
        if case["unsigned"]:
            request.context["client_config"] = Config(s3={"payload_signing_enabled": False})
        credentials = Credentials(case["access_key"], case["secret_key"], case["token"] or None)
        now = datetime.datetime.strptime(case["amz_date"], "%Y%m%dT%H%M%SZ")
        with mock.patch("botocore.auth.get_current_datetime", return_value=now):
            S3SigV4Auth(credentials, "s3", case["region"]).add_auth(request)
        theirs = request.headers["Authorization"]
        checked += 1
        if theirs != case["authorization"]:
            mismatches += 1
            print(f"mismatch for {case['method']} {url} (unsigned payload: {case['unsigned']}, "
                  f"botocore's payload hash {request.headers['X-Amz-Content-SHA256']})\n"
                  f"  strata:   {case['authorization']}\n  botocore: {theirs}")
    print(f"checked {checked}, mismatches {mismatches}")
    return 1 if mismatches or not checked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
